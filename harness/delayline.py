"""A TCP proxy on loopback that adds a round-trip time: network latency for benchmarks, without ``netem``.

Why it exists: the loader's whole point is hiding store latency, and on loopback there is none. The
kernel here has no ``netem`` and toxiproxy is not available, so latency is emulated in user space, in
front of a real server (SeaweedFS, an aiohttp test server, ...).

Model, and why it is shaped this way:

- Every chunk read from either socket is forwarded half an RTT later in its direction. Chunks wait in a
  per-connection, per-direction FIFO of ``(due_time, bytes)`` while the reader keeps reading, so the
  delay is *pipelined*: a 10 MB body costs about one RTT more, not one RTT per chunk.
- A new connection costs one RTT before any byte moves (the TCP handshake a real path would cost). The
  client's ``connect()`` itself returns at once, because the kernel completes the handshake before user
  space sees it; the cost shows on the first exchange instead (connect + first GET is about 2 RTT).
- Half-close (EOF) and resets travel through the same FIFO, so they arrive after the data sent before
  them. A reset is forwarded as an RST (``SO_LINGER`` 0), not as a clean close.
- Each direction holds at most ``max_buffered`` bytes; past that the proxy stops reading from the sender,
  so a slow reader pushes back on the writer as TCP would, and memory stays bounded. That bound acts as
  a window: one connection moves at most ``max_buffered / (rtt / 2)`` bytes per second (8 MiB default:
  measured ~270 MB/s at 50 ms, ~140 MB/s at 100 ms on one long stream; a body under 8 MiB is not slowed).
- Every chunk goes through :class:`Hook`, the one place a later fault-injecting proxy overrides (stall a
  chunk, rewrite it, reset the connection).

It runs on its own loop thread (``with DelayLine(...) as dl``) so a synchronous benchmark can talk to it,
or on the caller's running loop (``async with DelayLine(...) as dl``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import struct
from collections import deque
from dataclasses import dataclass
from typing import Literal, cast

from asyncload.runtime.loop import LoopKind, LoopThread

from ._service import LoopService

log = logging.getLogger("harness")

Direction = Literal["up", "down"]
"""``up``: client to upstream; ``down``: upstream to client."""

_EOF = object()
_RST = object()
_SLACK = 0.001  # uvloop timers are millisecond-grained: a timer may fire this much early
_LINGER_RST = struct.pack("ii", 1, 0)


class ResetConnection(Exception):
    """Raised by a :class:`Hook` to reset the connection: both sockets get an RST."""


@dataclass(frozen=True, slots=True)
class Conn:
    """What a hook knows about one proxied connection."""

    id: int  # 0, 1, 2, ... in accept order: "fail one in a hundred" needs no shared counter
    client: tuple[str, int]
    accepted_at: float  # loop time


class Hook:
    """Per-connection and per-chunk decisions; the default forwards everything unchanged.

    Subclass it for fault injection. Methods run on the proxy's loop thread and must not block.
    """

    def on_connect(self, conn: Conn) -> float:
        """Extra seconds before the connection carries bytes (a slow handshake); raise ResetConnection to refuse."""
        return 0.0

    def on_chunk(self, conn: Conn, direction: Direction, data: bytes) -> tuple[bytes, float]:
        """Return the bytes to forward (``b""`` drops them) and extra delay in seconds.

        Later chunks never overtake a delayed one (FIFO), so an extra delay is a stall of the stream.
        Raise ResetConnection to reset the connection after what was already queued towards the receiver.
        """
        return data, 0.0


class _Side(asyncio.Protocol):
    """One socket of a proxied connection: the client's (accepted) or the upstream's (dialled)."""

    def __init__(self, link: _Link) -> None:
        self.link = link
        self.transport: asyncio.Transport | None = None
        self.out: _Pipe  # bytes read here go into it
        self.inbound: _Pipe  # bytes written here come out of it
        self.eof_in = False  # the peer half-closed towards us
        self.eof_out = False  # we half-closed towards the peer
        self.closing = False  # we closed or aborted it ourselves
        self.gone = False  # connection lost, or never made

    # -- protocol callbacks ----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        if self.link.aborted:  # accepted or dialled just as the proxy stopped
            self.reset()
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:  # Nagle plus delayed ACKs would add 40 ms stalls that are not ours
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.transport.set_write_buffer_limits(high=256 << 10)
        if self is self.link.client:
            self.link.start(transport.get_extra_info("peername") or ("", 0))
        self.inbound.attach()

    def data_received(self, data: bytes) -> None:
        self.out.push(data)

    def eof_received(self) -> bool:
        self.eof_in = True
        self.out.push_mark(_EOF)
        self.close_if_done()
        return True  # keep the other half open: half-close must pass through

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self.inbound.detach()
        if not self.closing:
            if exc is not None:
                self.out.push_mark(_RST)
            elif not self.eof_in:
                self.out.push_mark(_EOF)
        self.link.side_gone()

    def pause_writing(self) -> None:
        self.inbound.set_writable(False)

    def resume_writing(self) -> None:
        self.inbound.set_writable(True)

    # -- actions ---------------------------------------------------------------------------------
    @property
    def open(self) -> bool:
        return self.transport is not None and not self.gone and not self.closing

    def pause_reading(self) -> None:
        if self.open:
            assert self.transport is not None
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.open:
            assert self.transport is not None
            self.transport.resume_reading()

    def write(self, data: bytes) -> None:
        if self.open:
            assert self.transport is not None
            self.transport.write(data)

    def write_eof(self) -> None:
        if self.open and not self.eof_out:
            assert self.transport is not None
            self.eof_out = True
            self.transport.write_eof()
            self.close_if_done()

    def close_if_done(self) -> None:
        if self.eof_in and self.eof_out and self.open:
            assert self.transport is not None
            self.closing = True
            self.transport.close()

    def reset(self) -> None:
        """Abort with an RST (a plain abort may send FIN, which the peer would read as a clean end)."""
        if self.transport is not None and not self.transport.is_closing():
            self.closing = True
            sock = self.transport.get_extra_info("socket")
            if sock is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                except OSError:
                    pass
            self.transport.abort()


class _Pipe:
    """One direction of one connection: a FIFO of ``(due, bytes | mark)`` flushed by a single timer."""

    def __init__(self, link: _Link, direction: Direction, src: _Side, dst: _Side) -> None:
        self.link, self.direction, self.src, self.dst = link, direction, src, dst
        src.out = dst.inbound = self
        self.q: deque[tuple[float, object]] = deque()
        self.queued = 0  # bytes in ``q``
        self.not_before = 0.0  # loop time the handshake ends: nothing is due earlier
        self.attached = False  # dst connected
        self.paused = False  # dst asked us to stop writing
        self.dead = False  # dst gone: drop everything
        self.src_paused = False
        self.timer: asyncio.TimerHandle | None = None

    def push(self, data: bytes) -> None:
        if self.dead:
            return
        line = self.link.line
        try:
            data, extra = line.hook.on_chunk(self.link.conn, self.direction, data)
        except ResetConnection:
            self.push_mark(_RST)
            self.src.reset()
            return
        if data:
            self._put(data, extra)
        if self.queued >= line.max_buffered and not self.src_paused:
            self.src_paused = True
            self.src.pause_reading()

    def push_mark(self, mark: object) -> None:
        """Queue EOF or RST behind the data already queued."""
        if not self.dead:
            self._put(mark, 0.0)

    def _put(self, item: object, extra: float) -> None:
        loop = self.link.loop
        due = max(loop.time(), self.not_before) + self.link.line.rtt_s / 2 + extra
        self.q.append((due, item))
        if isinstance(item, bytes):
            self.queued += len(item)
        self._arm()

    def _arm(self) -> None:
        if self.timer is None and self.q and self.attached and not self.paused and not self.dead:
            self.timer = self.link.loop.call_at(self.q[0][0], self._flush)

    def _flush(self) -> None:
        self.timer = None
        now = self.link.loop.time() + _SLACK
        while self.q and not self.paused and not self.dead and self.q[0][0] <= now:
            _, item = self.q.popleft()
            if item is _EOF:
                self.dst.write_eof()
            elif item is _RST:
                self.dst.reset()
            else:
                assert isinstance(item, bytes)
                self.queued -= len(item)
                self.dst.write(item)  # may call pause_writing synchronously, which ends this loop
        if self.src_paused and self.queued < self.link.line.max_buffered:  # no hysteresis: a gap would halve the window
            self.src_paused = False
            self.src.resume_reading()
        self._arm()

    def _cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def attach(self) -> None:
        self.attached = True
        self._arm()

    def set_writable(self, writable: bool) -> None:
        self.paused = not writable
        self._cancel()
        if writable:
            self._flush()

    def detach(self) -> None:
        self.dead = True
        self._cancel()
        self.q.clear()
        self.queued = 0
        if self.src_paused:
            self.src_paused = False
            self.src.resume_reading()


class _Link:
    """One proxied connection: two sockets, two pipes, and the upstream dial."""

    def __init__(self, line: DelayLine) -> None:
        self.line = line
        self.loop = line.loop
        self.conn = Conn(-1, ("", 0), 0.0)  # the real one is made in start(), once the socket exists
        self.client, self.upstream = _Side(self), _Side(self)
        self.up = _Pipe(self, "up", self.client, self.upstream)
        self.down = _Pipe(self, "down", self.upstream, self.client)
        self.dial: asyncio.Task[None] | None = None
        self.aborted = False

    def client_protocol(self) -> _Side:
        return self.client

    def start(self, peer: tuple[str, int]) -> None:
        """Called once the client socket exists: gate both pipes for one RTT and dial upstream."""
        self.conn = Conn(next(self.line._ids), (peer[0], peer[1]), self.loop.time())
        try:
            extra = self.line.hook.on_connect(self.conn)
        except ResetConnection:
            self.upstream.gone = True
            self.client.reset()
            return
        self.up.not_before = self.down.not_before = self.conn.accepted_at + self.line.rtt_s + extra
        self.dial = self.loop.create_task(self._dial())

    async def _dial(self) -> None:
        host, port = self.line.upstream
        try:
            await self.loop.create_connection(lambda: self.upstream, host, port)
        except OSError as exc:
            log.debug("delayline: upstream %s:%s refused connection %d: %s", host, port, self.conn.id, exc)
            self.upstream.gone = True
            self.up.detach()
            self.client.reset()
            self.side_gone()

    def side_gone(self) -> None:
        if self.client.gone and self.upstream.gone:
            self.line._links.discard(self)

    def abort(self) -> None:
        """Tear down at once (proxy shutdown): no more forwarding, both sockets reset."""
        self.aborted = True
        for pipe in (self.up, self.down):
            pipe.detach()
        if self.dial is not None:
            self.dial.cancel()
        for side in (self.client, self.upstream):
            if side.transport is None:
                side.gone = True  # never connected; if it connects later, connection_made resets it
            else:
                side.reset()
        self.side_gone()


class DelayLine(LoopService):
    """A loopback TCP proxy to ``upstream`` adding ``rtt_s`` of round-trip time (see the module docstring).

    ``with DelayLine(("127.0.0.1", port), rtt_s=0.05) as dl: ... dl.url ...`` runs it on a background
    thread; ``async with`` runs it on the current loop. ``set_rtt`` applies to bytes read afterwards.
    """

    _thread_name = "asyncload-delayline"

    def __init__(
        self,
        upstream: tuple[str, int],
        rtt_s: float = 0.0,
        *,
        hook: Hook | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_buffered: int = 8 << 20,
        backlog: int = 1024,
        loop: LoopKind = "auto",
    ) -> None:
        self.upstream = upstream
        self.hook = hook or Hook()
        self.host = host
        self.max_buffered = max(64 << 10, max_buffered)
        self._rtt = 0.0
        self.set_rtt(rtt_s)
        self._want_port = port
        self._backlog = backlog
        self._loop_kind: LoopKind = loop
        self._thread: LoopThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lsock: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._port: int | None = None
        self._links: set[_Link] = set()
        self._ids = itertools.count()

    # -- settings ------------------------------------------------------------------------------------
    @property
    def rtt_s(self) -> float:
        return self._rtt

    def set_rtt(self, rtt_s: float) -> None:
        """Change the RTT; safe from any thread (a float store). Bytes already queued keep their due time."""
        if not rtt_s >= 0:
            raise ValueError(f"rtt_s must be >= 0, got {rtt_s!r}")
        self._rtt = float(rtt_s)

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("DelayLine is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("DelayLine is not started")
        return self._loop

    @property
    def connections(self) -> int:
        """Connections not yet fully closed (approximate when read from another thread)."""
        return len(self._links)

    # -- on the loop -----------------------------------------------------------------------------------
    async def _open(self) -> None:
        self._loop = asyncio.get_running_loop()
        lsock = socket.create_server((self.host, self._want_port), backlog=self._backlog)
        lsock.setblocking(False)
        self._lsock = lsock
        self._port = lsock.getsockname()[1]
        self._acceptor = self._loop.create_task(self._accept_loop(lsock))

    async def _accept_loop(self, lsock: socket.socket) -> None:
        """Accept and wrap each socket here rather than via ``create_server``.

        Why: with ``asyncio.Server`` a socket accepted just before ``close()`` can be left open and
        unowned (the transport refuses a closed server). Here a socket is either still in the kernel's
        queue (closed with the listener) or has a transport (aborted with its link).
        """
        loop = self.loop
        while True:
            conn, _ = await loop.sock_accept(lsock)
            link = _Link(self)
            self._links.add(link)
            try:
                await loop.connect_accepted_socket(link.client_protocol, conn)
            except OSError as exc:  # the client went away between accept and wrap
                log.debug("delayline: accepted socket failed: %s", exc)
                conn.close()
                link.abort()

    async def _close(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        acceptor, self._acceptor = self._acceptor, None
        if acceptor is not None:
            acceptor.cancel()
            await asyncio.gather(acceptor, return_exceptions=True)
        if self._lsock is not None:
            self._lsock.close()
            self._lsock = None
        for link in list(self._links):
            link.abort()
        deadline = loop.time() + timeout
        while self._links and loop.time() < deadline:
            await asyncio.sleep(0.005)  # connection_lost callbacks run on the next iterations
        if self._links:
            log.warning("delayline: %d connections did not close in time", len(self._links))
        self._links.clear()

    # -- lifecycle: own thread (LoopService), or the caller's loop ----------------------------------------
    def _started(self) -> bool:
        return self._thread is not None or self._lsock is not None

    async def __aenter__(self) -> DelayLine:
        if self._thread is not None or self._lsock is not None:
            raise RuntimeError("DelayLine already started")
        await self._open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close(2.5)
        self._loop = None


class DelayLineProcess:
    """A ``DelayLine`` in a process of its own, so that forwarding bytes never competes for the GIL
    with the loader being measured. Same ``url``/``port``/``set_rtt`` as ``DelayLine``; a context manager.

    The child reads commands from its stdin (``rtt SECONDS``) and stops at end of input, so it also
    ends when this process dies.
    """

    def __init__(self, upstream: tuple[str, int], rtt_s: float = 0.0, *, host: str = "127.0.0.1") -> None:
        import subprocess
        import sys

        self.host = host
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "harness.delayline", f"{upstream[0]}:{upstream[1]}", "--rtt", str(rtt_s), "--host", host],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line.startswith("port "):
            self.stop()
            raise RuntimeError(f"delay line process did not start (said {line!r})")
        self.port = int(line.split()[1])
        self._rtt = rtt_s

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def rtt_s(self) -> float:
        return self._rtt

    def set_rtt(self, rtt_s: float) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(f"rtt {rtt_s}\n")
        self._proc.stdin.flush()
        self._proc.stdout.readline()  # "ok": applied before this returns
        self._rtt = rtt_s

    def stop(self, timeout: float = 5.0) -> None:
        if self._proc.poll() is None:
            try:
                assert self._proc.stdin is not None
                self._proc.stdin.close()
                self._proc.wait(timeout)
            except Exception:  # noqa: BLE001 - fall back to a kill
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> DelayLineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m harness.delayline HOST:PORT --rtt S``: prints ``port N``, then obeys
    ``rtt S`` lines on stdin (answering ``ok``) until end of input."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m harness.delayline")
    ap.add_argument("upstream", help="HOST:PORT to forward to")
    ap.add_argument("--rtt", type=float, default=0.0, help="added round-trip time in seconds")
    ap.add_argument("--host", default="127.0.0.1")
    args = ap.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    with DelayLine((host, int(port)), rtt_s=args.rtt, host=args.host) as dl:
        print(f"port {dl.port}", flush=True)
        for line in sys.stdin:
            cmd, _, value = line.strip().partition(" ")
            if cmd == "rtt":
                dl.set_rtt(float(value))
            print("ok", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
