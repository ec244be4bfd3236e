"""DelayLine against a real HTTP server (aiohttp in a subprocess, so it does not share our GIL) and raw sockets."""

from __future__ import annotations

import asyncio
import http.client
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from harness.delayline import Conn, DelayLine, Direction, Hook, ResetConnection
from harness.netcheck import measure_path

RTT = 0.05
SMALL = b"s" * 100
LARGE = bytes(range(256)) * (8 << 12)  # 8 MiB, patterned so a reordered or lost chunk shows

_SERVER = """
import asyncio, socket, sys
from aiohttp import web

SMALL = b"s" * 100
LARGE = bytes(range(256)) * (8 << 12)

async def main():
    app = web.Application()
    app.router.add_get("/small", lambda r: asyncio.sleep(0, web.Response(body=SMALL)))
    app.router.add_get("/large", lambda r: asyncio.sleep(0, web.Response(body=LARGE)))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock, backlog=1024).start()
    print(sock.getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # parent closed stdin: stop
    await runner.cleanup()

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, int]]:
    """An aiohttp server on loopback serving /small (100 B) and /large (8 MiB); stops when stdin closes."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield ("127.0.0.1", port)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get(conn: http.client.HTTPConnection, path: str) -> bytes:
    conn.request("GET", path)
    resp = conn.getresponse()
    body = resp.read()
    assert resp.status == 200
    return body


def timed_gets(host: str, port: int, path: str, n: int) -> list[float]:
    """``n`` GETs on one warm keep-alive connection (the first, which pays the connect, is not counted)."""
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        get(conn, path)
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            body = get(conn, path)
            out.append(time.perf_counter() - t0)
            assert body == (SMALL if path == "/small" else LARGE)
        return out
    finally:
        conn.close()


def first_get(host: str, port: int) -> float:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(host, port, timeout=10)
    try:
        assert get(conn, "/small") == SMALL
    finally:
        conn.close()
    return time.perf_counter() - t0


def delayline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("asyncload-delayline")]


def wait_until(cond: Callable[[], bool], deadline_s: float) -> bool:
    end = time.monotonic() + deadline_s
    while not cond() and time.monotonic() < end:
        time.sleep(0.01)
    return cond()


@pytest.mark.timeout(30)
def test_small_get_round_trip_is_one_rtt_and_follows_set_rtt(server: tuple[str, int]) -> None:
    with DelayLine(server, rtt_s=RTT) as dl:
        med = statistics.median(timed_gets(dl.host, dl.port, "/small", 10))
        assert 0.045 <= med <= 0.09, med
        dl.set_rtt(0.02)
        med = statistics.median(timed_gets(dl.host, dl.port, "/small", 10))
        assert 0.018 <= med <= 0.045, med


@pytest.mark.timeout(30)
def test_connect_plus_first_get_costs_two_rtt(server: tuple[str, int]) -> None:
    with DelayLine(server, rtt_s=RTT) as dl:
        med = statistics.median(first_get(dl.host, dl.port) for _ in range(3))
    assert 1.9 * RTT <= med <= 2 * RTT + 0.04, med


@pytest.mark.timeout(30)
def test_large_get_is_pipelined_not_delayed_per_chunk(server: tuple[str, int]) -> None:
    direct = min(timed_gets(*server, "/large", 2))
    with DelayLine(server, rtt_s=RTT) as dl:
        delayed = min(timed_gets(dl.host, dl.port, "/large", 2))
    # one RTT for request and response; per-chunk delay would be ~128 chunks x RTT/2 = seconds
    assert RTT <= delayed < direct + 4 * RTT, (direct, delayed)


@pytest.mark.timeout(30)
def test_200_concurrent_connections_complete_in_a_few_rtt(server: tuple[str, int]) -> None:
    async def one(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = await reader.read()  # to EOF: the server's close must come through
        writer.close()
        await writer.wait_closed()
        return data

    async def many(port: int) -> list[bytes]:
        return await asyncio.gather(*(one(port) for _ in range(200)))

    with DelayLine(server, rtt_s=RTT) as dl:
        t0 = time.perf_counter()
        replies = asyncio.run(many(dl.port))
        took = time.perf_counter() - t0
        assert wait_until(lambda: dl.connections == 0, 5), dl.connections
    assert all(r.startswith(b"HTTP/1.1 200") and r.endswith(SMALL) for r in replies)
    assert took < 20 * RTT, took  # serialised it would be 200 x 2 RTT = 20 s


@pytest.mark.timeout(30)
def test_runs_on_the_callers_loop(server: tuple[str, int]) -> None:
    async def main() -> float:
        async with DelayLine(server, rtt_s=RTT) as dl:
            t0 = time.perf_counter()
            reader, writer = await asyncio.open_connection(dl.host, dl.port)
            writer.write(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert (await reader.read()).endswith(SMALL)
            took = time.perf_counter() - t0
            writer.close()
            await writer.wait_closed()
            return took

    assert 1.9 * RTT <= asyncio.run(main()) <= 2 * RTT + 0.04


class _RawUpstream:
    """A one-connection raw TCP server on a thread, running ``handler(conn)``; for EOF and RST cases."""

    def __init__(self, handler: Callable[[socket.socket], None]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.addr: tuple[str, int] = self.sock.getsockname()
        self.thread = threading.Thread(target=self._run, args=(handler,), daemon=True)
        self.thread.start()

    def _run(self, handler: Callable[[socket.socket], None]) -> None:
        conn, _ = self.sock.accept()
        with conn:
            handler(conn)

    def close(self) -> None:
        self.thread.join(5)
        self.sock.close()


def _recv_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.timeout(30)
def test_half_close_passes_through_after_the_delayed_data() -> None:
    def count_then_answer(conn: socket.socket) -> None:
        n = len(_recv_all(conn))  # ends only when the client's EOF arrives, after all its bytes
        conn.sendall(b"got %d" % n)
        conn.shutdown(socket.SHUT_WR)

    up = _RawUpstream(count_then_answer)
    with DelayLine(up.addr, rtt_s=0.02) as dl, socket.create_connection((dl.host, dl.port), timeout=10) as c:
        c.sendall(b"x" * 3_000_000)
        c.shutdown(socket.SHUT_WR)
        assert _recv_all(c) == b"got 3000000"
    up.close()


@pytest.mark.timeout(30)
def test_upstream_reset_reaches_the_client_as_a_reset() -> None:
    def reset(conn: socket.socket) -> None:
        conn.recv(100)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    up = _RawUpstream(reset)
    with DelayLine(up.addr, rtt_s=0.02) as dl, socket.create_connection((dl.host, dl.port), timeout=10) as c:
        c.sendall(b"hello")
        with pytest.raises(ConnectionResetError):
            _recv_all(c)
    up.close()


@pytest.mark.timeout(30)
def test_slow_reader_bounds_the_queue_and_loses_nothing() -> None:
    total = 24 << 20

    def flood(conn: socket.socket) -> None:
        conn.recv(10)
        conn.sendall(b"z" * total)
        conn.shutdown(socket.SHUT_WR)

    up = _RawUpstream(flood)
    limit = 1 << 20
    with (
        DelayLine(up.addr, rtt_s=0.02, max_buffered=limit) as dl,
        socket.create_connection((dl.host, dl.port), timeout=10) as c,
    ):
        c.sendall(b"go")
        time.sleep(0.4)  # not reading: the proxy must stop reading too, not buffer the 24 MB
        queued = [link.down.queued for link in list(dl._links)]
        assert queued and 0 < max(queued) <= limit + (512 << 10), queued
        assert len(_recv_all(c)) == total
    up.close()


class _CutAndStall(Hook):
    """Connection 0: the first response chunk stalls 0.3 s. Connection 1: reset after 1 MB of response."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}

    def on_chunk(self, conn: Conn, direction: Direction, data: bytes) -> tuple[bytes, float]:
        if direction == "down":
            before = self.sent.get(conn.id, 0)
            self.sent[conn.id] = before + len(data)
            if conn.id == 0 and before == 0:
                return data, 0.3
            if conn.id == 1 and before + len(data) > 1_000_000:
                raise ResetConnection
        return data, 0.0


@pytest.mark.timeout(30)
def test_hook_can_stall_a_chunk_and_reset_mid_body(server: tuple[str, int]) -> None:
    with DelayLine(server, rtt_s=0.0, hook=_CutAndStall()) as dl:
        assert first_get(dl.host, dl.port) >= 0.3
        conn = http.client.HTTPConnection(dl.host, dl.port, timeout=10)
        with pytest.raises((ConnectionResetError, http.client.IncompleteRead)):
            get(conn, "/large")
        conn.close()
        assert first_get(dl.host, dl.port) < 0.3  # connection 2 is untouched


@pytest.mark.timeout(30)
def test_stop_closes_everything_and_leaves_no_thread(server: tuple[str, int]) -> None:
    dl = DelayLine(server, rtt_s=RTT).start()
    port = dl.port
    busy = http.client.HTTPConnection(dl.host, port, timeout=10)
    get(busy, "/small")  # a keep-alive connection left open
    idle = socket.create_connection((dl.host, port), timeout=5)  # a connection still in its handshake delay
    t0 = time.perf_counter()
    assert dl.stop()
    assert time.perf_counter() - t0 < 3
    assert wait_until(lambda: not delayline_threads(), 5), delayline_threads()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    try:
        assert idle.recv(10) == b""  # closed (an RST would raise instead; either is fine)
    except ConnectionResetError:
        pass
    idle.close()
    busy.close()
    assert dl.stop()  # idempotent


@pytest.mark.timeout(60)
def test_measure_path_reports_the_emulated_path(server: tuple[str, int]) -> None:
    direct = measure_path(f"http://{server[0]}:{server[1]}", n=5, fresh=2)
    with DelayLine(server, rtt_s=RTT) as dl:
        delayed = measure_path(dl.url, n=5, fresh=2)
    assert direct["large_bytes"] == delayed["large_bytes"] == len(LARGE)
    assert 0.045 <= delayed["small_get_s"] - direct["small_get_s"] <= 0.09
    assert 0.8 * RTT <= delayed["handshake_s"] <= 1.6 * RTT
    assert delayed["large_get_s"] < direct["large_get_s"] + 4 * RTT
