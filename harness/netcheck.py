"""Measure an HTTP path (connect, small-GET round trip, large-GET bandwidth), to check the emulated network.

Why: a benchmark run behind a :class:`~harness.delayline.DelayLine` is only meaningful if the
path really has the RTT it claims and the bandwidth is not throttled by the emulation; these figures go
into the benchmark report next to the throughput numbers.

Plain ``http.client`` on the calling thread, one request at a time: no pool, no event loop, so what is
measured is the path, not a client library. Through a proxy a bare TCP connect returns at once (the
kernel finishes the handshake before user space sees it), so the connect cost is reported as
``handshake_s`` = (connect + first GET) - (GET on a warm connection).

    python -m harness.netcheck http://127.0.0.1:8333 --rtt 0.05
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import time
from typing import Any
from urllib.parse import urlsplit

from .delayline import DelayLine


def _host_port(url_base: str) -> tuple[str, int]:
    u = urlsplit(url_base)
    if u.scheme != "http" or not u.hostname:
        raise ValueError(f"need an http://host:port URL, got {url_base!r}")
    return u.hostname, u.port or 80


def _get(conn: http.client.HTTPConnection, path: str, buf: memoryview) -> tuple[int, float]:
    """One GET on ``conn``: (body bytes, seconds until the headers were in).

    The body is read to the end into ``buf`` (reused, so big bodies cost no allocation).
    """
    t0 = time.perf_counter()
    conn.request("GET", path)
    resp = conn.getresponse()
    ttfb = time.perf_counter() - t0
    total = 0
    while n := resp.readinto(buf):
        total += n
    if resp.status != 200:
        raise RuntimeError(f"GET {path}: HTTP {resp.status}")
    return total, ttfb


def measure_path(
    url_base: str,
    *,
    small_path: str = "/small",
    large_path: str = "/large",
    n: int = 20,
    fresh: int = 5,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Connect time, first-GET time on new connections, small-GET RTT on a warm one, one large GET.

    Medians over ``fresh`` new connections and ``n`` warm GETs, so one scheduler hiccup does not move them.
    """
    host, port = _host_port(url_base)
    buf = memoryview(bytearray(1 << 20))
    connects, firsts = [], []
    for _ in range(fresh):
        t0 = time.perf_counter()
        socket.create_connection((host, port), timeout=timeout).close()
        connects.append(time.perf_counter() - t0)
    for _ in range(fresh):
        conn = http.client.HTTPConnection(host, port, timeout=timeout)
        t0 = time.perf_counter()
        _get(conn, small_path, buf)
        firsts.append(time.perf_counter() - t0)
        conn.close()

    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        _get(conn, small_path, buf)  # pays the handshake; not a round trip sample
        rtts = []
        for _ in range(n):
            t0 = time.perf_counter()
            _get(conn, small_path, buf)
            rtts.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        size, ttfb = _get(conn, large_path, buf)
        large_s = time.perf_counter() - t0
    finally:
        conn.close()

    rtt = statistics.median(rtts)
    first = statistics.median(firsts)
    return {
        "url": url_base,
        "connect_s": statistics.median(connects),
        "first_get_s": first,
        "handshake_s": first - rtt,
        "small_get_s": rtt,
        "small_get_min_s": min(rtts),
        "small_get_max_s": max(rtts),
        "large_bytes": size,
        "large_get_s": large_s,
        "large_ttfb_s": ttfb,
        # body bytes over the time after the headers: the path's bandwidth, the RTT taken out
        "large_mb_s": size / max(large_s - ttfb, 1e-9) / 1e6,
    }


def compare_paths(url_base: str, rtt_s: float, **kwargs: Any) -> dict[str, Any]:
    """``measure_path`` straight to ``url_base`` and through a DelayLine of ``rtt_s`` in front of it."""
    direct = measure_path(url_base, **kwargs)
    with DelayLine(_host_port(url_base), rtt_s=rtt_s) as dl:
        delayed = measure_path(dl.url, **kwargs)
    return {
        "rtt_set_s": rtt_s,
        "direct": direct,
        "delayed": delayed,
        "added_rtt_s": delayed["small_get_s"] - direct["small_get_s"],
        "added_handshake_s": delayed["handshake_s"] - direct["handshake_s"],
        "added_large_s": delayed["large_get_s"] - direct["large_get_s"],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("url", help="http://host:port of a server with a small and a large GET path")
    p.add_argument("--rtt", type=float, nargs="*", default=[0.0, 0.02, 0.05, 0.1])
    p.add_argument("--small", default="/small")
    p.add_argument("--large", default="/large")
    a = p.parse_args(argv)
    out = [compare_paths(a.url, r, small_path=a.small, large_path=a.large) for r in a.rtt]
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
