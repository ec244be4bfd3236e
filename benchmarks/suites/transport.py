"""Which S3 transport should the object-store source use? aiohttp + asyncload's SigV4 signer, or obstore.

Measures, against a local SeaweedFS (signatures checked), for ~100 KB objects with 64 GETs in flight:

- **client CPU per GET**: the client process's CPU time (every thread: the event loop, obstore's Rust
  runtime) divided by the GETs it completed, which is what caps throughput on a small machine;
- **GETs/s** over the same window.

Each (transport, repetition) runs in a fresh client process, so one transport's threads and pools never
tax the other's figures; the first ``--warmup`` GETs (opening the connections) are not counted. Both
clients read the whole body into memory, as the source does before decoding. With ``--rtt 50`` and
``benchmarks/testbeds/netem.py`` able to build its namespaces, the server sits behind 50 ms of packet-level
round trip; that runs only when ``ip netns list`` is empty (another benchmark may own the namespaces).

    python benchmarks/suites/transport.py --rtt 0 [50] --reps 3     # writes benchmarks/results/transport/
    python benchmarks/suites/transport.py report                    # re-renders transport.md from transport.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "transport"
BUCKET = "transport"
TRANSPORTS = ("aiohttp-sigv4", "obstore")


async def _client_aiohttp(endpoint: str, region: str, keys: list[str], gets: int, inflight: int, warmup: int) -> dict:
    from asyncload.sources.stores.http import Timeouts, new_session, request_bytes
    from asyncload.sources.stores.s3 import S3Endpoint
    from asyncload.sources.stores.sigv4 import Credentials

    s3 = S3Endpoint(endpoint, region, Credentials(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]))
    async with new_session(2 * inflight, Timeouts(), True) as session:

        async def get(key: str) -> int:
            url = s3.url(BUCKET, key)
            return len(await request_bytes(session, "GET", url, s3.headers("GET", url), allow_redirects=False))

        return await _drive(get, keys, gets, inflight, warmup)


async def _client_obstore(endpoint: str, region: str, keys: list[str], gets: int, inflight: int, warmup: int) -> dict:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        BUCKET,
        endpoint=endpoint,
        region=region,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True, "pool_max_idle_per_host": str(2 * inflight)},
    )

    async def get(key: str) -> int:
        result = await obstore.get_async(store, key)
        return len(await result.bytes_async())

    return await _drive(get, keys, gets, inflight, warmup)


async def _drive(get: Any, keys: list[str], gets: int, inflight: int, warmup: int) -> dict:
    """``inflight`` workers GET keys round-robin; time and CPU are counted after ``warmup`` GETs."""
    counter = iter(range(warmup + gets))
    done = 0
    nbytes = 0
    mark: dict[str, float] = {}

    async def worker() -> None:
        nonlocal done, nbytes
        for n in counter:
            size = await get(keys[n % len(keys)])
            done += 1
            if done == warmup:
                mark.update(wall=time.perf_counter(), cpu=time.process_time())
            elif done > warmup:
                nbytes += size

    await asyncio.gather(*(worker() for _ in range(inflight)))
    wall, cpu = time.perf_counter() - mark["wall"], time.process_time() - mark["cpu"]
    counted = done - warmup
    return {"gets": counted, "wall_s": wall, "cpu_s": cpu, "bytes": nbytes}


def client_main(args: argparse.Namespace) -> int:
    """One measurement in this process; JSON on stdout."""
    from asyncload.runtime.loop import _new_event_loop

    fn = {"aiohttp-sigv4": _client_aiohttp, "obstore": _client_obstore}[args.transport]
    keys = [f"obj/{i:05d}.bin" for i in range(args.objects)]
    loop = _new_event_loop("auto")
    try:
        res = loop.run_until_complete(fn(args.endpoint, args.region, keys, args.gets, args.inflight, args.warmup))
    finally:
        loop.close()
    print(json.dumps(res))
    return 0


def _measure(server: Any, endpoint: str, transport: str, args: argparse.Namespace, prefix: list[str]) -> dict:
    env = dict(os.environ, **{k: v for k, v in server.env().items() if k.startswith("AWS_")})
    cmd = [*prefix, sys.executable, __file__, "_client", "--transport", transport, "--endpoint", endpoint,
           "--region", server.region, "--objects", str(args.objects), "--gets", str(args.gets),
           "--inflight", str(args.inflight), "--warmup", str(args.warmup)]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _netns_free() -> bool:
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return not out.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="run", choices=["run", "report", "_client"])
    ap.add_argument("--transport", choices=TRANSPORTS)
    ap.add_argument("--endpoint")
    ap.add_argument("--region", default="us-east-1")
    ap.add_argument("--objects", type=int, default=256)
    ap.add_argument("--size", type=int, default=100_000, help="bytes per object")
    ap.add_argument("--gets", type=int, default=4000, help="GETs counted per measurement")
    ap.add_argument("--warmup", type=int, default=256)
    ap.add_argument("--inflight", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rtt", type=float, nargs="*", default=[0.0], help="round trips in ms (0, 50)")
    args = ap.parse_args(argv)
    if args.mode == "_client":
        return client_main(args)
    if args.mode == "report":  # re-render the markdown from the last run's JSON
        doc = json.loads((OUT / "transport.json").read_text())
        (OUT / "transport.md").write_text(_markdown(doc["meta"], doc["summary"]))
        print(_markdown(doc["meta"], doc["summary"]))
        return 0

    from harness.seaweed import SeaweedServer

    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for rtt in args.rtt:
        if not rtt:
            with SeaweedServer() as server:
                rows += _run_rtt(server, server.endpoint_url, [], 0.0, args)
            continue
        if not _netns_free():
            notes.append(f"{rtt:g} ms not measured: `ip netns list` showed namespaces of another run")
            continue
        sys.path.insert(0, str(ROOT))
        from benchmarks.testbeds import netem

        with netem.network(ROOT / "data" / "netem") as net:
            net.enter_server()  # set up and upload from the server's side: no delay
            with SeaweedServer(host=net.server_host) as server:
                net.set_rtt(rtt / 1000)
                packet = isinstance(net, netem.PacketNet)
                prefix = ["ip", "netns", "exec", net.ns["client"]] if packet else []
                notes.append(f"{rtt:g} ms: {net.emulation}")
                rows += _run_rtt(server, net.url(server.port), prefix, rtt, args)
    summary = _summarise(rows)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {
        "objects": args.objects, "size": args.size, "gets": args.gets, "warmup": args.warmup,
        "inflight": args.inflight, "reps": args.reps, "cores": len(os.sched_getaffinity(0)),
        "python": platform.python_version(), "machine": platform.machine(), "notes": notes,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_avg_end": os.getloadavg(),
    }  # fmt: skip
    try:
        import obstore

        meta["obstore"] = obstore.__version__
    except ImportError:
        pass
    (OUT / "transport.json").write_text(json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=1))
    (OUT / "transport.md").write_text(_markdown(meta, summary))
    print(_markdown(meta, summary))
    return 0


def _run_rtt(server: Any, endpoint: str, prefix: list[str], rtt: float, args: argparse.Namespace) -> list[dict]:
    """Upload the objects, then every transport ``args.reps`` times, interleaved (drift hits both)."""
    server.create_bucket(BUCKET)
    blob = os.urandom(args.size)  # incompressible; a distinct head per object
    for i in range(args.objects):
        server.put_object(BUCKET, f"obj/{i:05d}.bin", i.to_bytes(4, "big") + blob[4:])
    rows = []
    for rep in range(args.reps):
        for transport in TRANSPORTS:
            r = _measure(server, endpoint, transport, args, prefix) | {
                "transport": transport,
                "rtt_ms": rtt,
                "rep": rep,
            }
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def _summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for rtt in sorted({r["rtt_ms"] for r in rows}):
        for t in TRANSPORTS:
            mine = [r for r in rows if r["transport"] == t and r["rtt_ms"] == rtt]
            if not mine:
                continue
            cpu = [1e6 * r["cpu_s"] / r["gets"] for r in mine]
            rate = [r["gets"] / r["wall_s"] for r in mine]
            out.append({
                "transport": t, "rtt_ms": rtt, "cpu_us_per_get_median": statistics.median(cpu),
                "cpu_us_per_get": cpu, "gets_per_s_median": statistics.median(rate), "gets_per_s": rate,
            })  # fmt: skip
    return out


def _markdown(meta: dict[str, Any], summary: list[dict[str, Any]]) -> str:
    lines = [
        "# S3 transport: aiohttp + asyncload's SigV4 signer vs obstore",
        "",
        f"SeaweedFS on loopback (signatures checked), {meta['objects']} objects of {meta['size']:,} bytes, "
        f"{meta['inflight']} GETs in flight, {meta['gets']:,} GETs counted per run after {meta['warmup']} to warm up, "
        f"{meta['reps']} runs each in a fresh client process, interleaved; {meta['cores']} cores shared with the "
        f"server; obstore {meta.get('obstore', '?')}; {meta['date']}.",
        "",
        "| RTT | transport | client CPU per GET (µs), median | runs | GETs/s, median | runs |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['rtt_ms']:g} ms | {s['transport']} | {s['cpu_us_per_get_median']:.0f} | "
            f"{', '.join(f'{v:.0f}' for v in s['cpu_us_per_get'])} | {s['gets_per_s_median']:.0f} | "
            f"{', '.join(f'{v:.0f}' for v in s['gets_per_s'])} |"
        )
    lines.append("")
    for rtt in sorted({s["rtt_ms"] for s in summary}):
        by = {s["transport"]: s for s in summary if s["rtt_ms"] == rtt}
        if len(by) == 2:
            a, o = by["aiohttp-sigv4"], by["obstore"]
            cpu = o["cpu_us_per_get_median"] / a["cpu_us_per_get_median"]
            rate = o["gets_per_s_median"] / a["gets_per_s_median"]
            lines.append(
                f"- {rtt:g} ms: obstore's CPU per GET is {cpu:.2f}x aiohttp's, its GETs/s {rate:.2f}x (medians)."
            )
    lines += [*[f"- {n}" for n in meta["notes"]], ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
