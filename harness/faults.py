"""A fault-injecting HTTP reverse proxy for tests: put it in front of a real S3 server and break things on cue.

Why an HTTP proxy, and why this shape:

- **Faults at the HTTP level, the real client untouched.** The retry policy, the error messages and the
  skip path of asyncload (and Deep Lake's own retries) are only trustworthy when they meet the answers a
  real store gives under stress: 500 ``InternalError``, a load balancer's 503, S3's 503 ``SlowDown``,
  429 with ``Retry-After``, a body cut off by a reset, a request that hangs, a server that is gone. The
  proxy produces exactly those on the wire; nothing inside asyncload is patched, so a test exercises the
  same code a user runs. (:mod:`.delayline` works a level lower, on TCP chunks; this one understands
  requests, which is what "the next 20 requests" needs.)
- **Signatures still verify.** SigV4 signs the ``Host`` header (``host:port`` of the endpoint the client
  was given, see :meth:`asyncload.sources.stores.sigv4.SigV4Signer.sign`), the exact encoded path and query, and the
  ``x-amz-*`` headers. The client is given the *proxy's* URL, so it signs the proxy's ``host:port``; the
  proxy forwards every request header unchanged, ``Host`` included (aiohttp's client keeps an explicit
  ``Host`` header instead of deriving one from the URL), and the raw path and query byte for byte.
  aiohttp's automatic ``Accept-Encoding``/``User-Agent`` are suppressed so the server sees only what the
  client sent (a gzip answer to a client that never asked for one would corrupt the body).
- **Streaming.** Forwarded bodies are copied chunk by chunk as they arrive, with the upstream's
  ``Content-Length`` kept, so the proxy adds no buffering a real path would not have.
- **A schedule that can change while requests flow.** :class:`FaultSchedule` holds rules ("the next 20
  requests get a 503", "one GET in 20 is stalled 3 s", "this key always answers 403") and the down state;
  every method takes a lock, so a test thread can change it while the proxy's loop thread consults it.
  Each rule counts the requests that match it, so "requests k..k+N" is about the requests it cares
  about (object GETs, one key), not about the listing and probe requests around them.
- **Down means down.** ``down(refuse=True)`` closes the listening socket (new connections are refused, as
  by a stopped server) and resets every open connection with an RST; after ``for_s`` seconds the proxy
  listens again on the same port. ``refuse=False`` keeps listening but resets every request.
- **Counted.** The proxy counts what it actually did per fault kind (:meth:`FaultProxy.counts`), so a
  test can assert that the fault it configured really happened before it credits the retries.

Usage::

    with FaultProxy(("127.0.0.1", server.port)) as proxy:
        proxy.schedule.burst(Fault.HTTP_503, 20, match="/files/")
        creds = dict(server.creds(), endpoint_url=proxy.url)
        ...
        assert proxy.counts()[Fault.HTTP_503] == 20

Command line (foreground until Ctrl-C; every N-th request fails with the given kind)::

    python -m harness.faults --upstream 127.0.0.1:8333 [--port 9333] [--every http_503=10]
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import logging
import socket
import struct
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web
from yarl import URL

from asyncload.runtime.loop import LoopKind, LoopThread

from ._service import LoopService

log = logging.getLogger("harness")

_LINGER_RST = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends an RST, not a FIN
# Hop-by-hop headers (RFC 9110 §7.6.1) belong to one connection, never forwarded; the length is set apart.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer",
        "Transfer-Encoding", "Upgrade", "Content-Length",
    )
)  # fmt: skip


class Fault(enum.StrEnum):
    """What the proxy can do to a request instead of (or on top of) forwarding it."""

    HTTP_500 = "http_500"  # S3's 500 InternalError (XML body)
    HTTP_503 = "http_503"  # a plain 503 Service Unavailable (a load balancer's, no S3 body)
    SLOW_DOWN = "slow_down"  # S3's 503 with <Code>SlowDown</Code>
    HTTP_429 = "http_429"  # 429 Too Many Requests with a Retry-After header
    RESET = "reset_mid_body"  # headers and part of the body forwarded, then an RST
    STALL = "stall"  # forwarded after a delay (a straggler)
    HTTP_403 = "http_403"  # S3's 403 AccessDenied (permanent)
    HTTP_404 = "http_404"  # S3's 404 NoSuchKey (permanent)
    DOWN = "down"  # a request that met the proxy while it was down: reset without an answer


_S3_ERRORS: dict[Fault, tuple[int, str, str]] = {
    Fault.HTTP_500: (500, "InternalError", "We encountered an internal error. Please try again."),
    Fault.SLOW_DOWN: (503, "SlowDown", "Please reduce your request rate."),
    Fault.HTTP_429: (429, "TooManyRequests", "Too many requests; retry after the time given."),
    Fault.HTTP_403: (403, "AccessDenied", "Access Denied"),
    Fault.HTTP_404: (404, "NoSuchKey", "The specified key does not exist."),
}


def _s3_error_body(code: str, message: str, resource: str) -> bytes:
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource>"
        "<RequestId>faultproxy</RequestId></Error>"
    ).encode()


@dataclass
class Rule:
    """One fault rule; see :meth:`FaultSchedule.add`. Counters are updated under the schedule's lock."""

    kind: Fault
    count: int | None = None  # faults to inject in all; None: no limit (for good)
    skip: int = 0  # matching requests let through before the first fault ("requests k..k+N": skip=k)
    every: int = 1  # after ``skip``, fault one matching request in ``every`` (the last of each group)
    match: str | None = None  # substring of the raw path and query; None: every request
    methods: frozenset[str] | None = None  # e.g. {"GET"}; None: every method
    once_per_key: bool = False  # fault a given path at most once (a retry or hedge of it goes through)
    stall_s: float = 3.0  # STALL: extra seconds before forwarding
    retry_after: float = 1.0  # HTTP_429 (and optionally 503s): the Retry-After value in seconds
    seen: int = 0  # matching requests examined
    hits: int = 0  # faults injected
    _keys: set[str] = field(default_factory=set, repr=False)

    def matches(self, method: str, path: str) -> bool:
        if self.methods is not None and method.upper() not in self.methods:
            return False
        return self.match is None or self.match in path

    @property
    def exhausted(self) -> bool:
        return self.count is not None and self.hits >= self.count

    def fires(self, path: str) -> bool:
        """Count one matching request; True when it is to be faulted. Call under the schedule's lock."""
        if self.exhausted:
            return False
        self.seen += 1
        n = self.seen - self.skip
        if n <= 0 or n % self.every != 0:
            return False
        if self.once_per_key:
            if path in self._keys:
                return False
            self._keys.add(path)
        self.hits += 1
        return True


@dataclass(frozen=True)
class Decision:
    """What to do with one request: the fault kind and the rule's parameters."""

    kind: Fault
    stall_s: float = 0.0
    retry_after: float = 0.0


class FaultSchedule:
    """Fault rules and the down state; thread-safe (every method takes the lock).

    Rules are examined in the order they were added; the first one that fires takes the request, and
    rules after it do not see (or count) that request. While the proxy is down, no rule sees requests.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rules: list[Rule] = []
        self._down_until: float | None = None  # monotonic deadline; inf: for good; None: up
        self._refuse = True
        self._listeners: list[Callable[[], None]] = []

    # -- rules -----------------------------------------------------------------------------------
    def add(
        self,
        kind: Fault | str,
        *,
        count: int | None = None,
        skip: int = 0,
        every: int = 1,
        match: str | None = None,
        methods: set[str] | frozenset[str] | None = None,
        once_per_key: bool = False,
        stall_s: float = 3.0,
        retry_after: float = 1.0,
    ) -> Rule:
        """Add a rule and return it (its ``seen``/``hits`` show progress).

        ``count`` faults in all (None: for good); ``skip`` matching requests pass first; then one in
        ``every`` is faulted; ``match`` restricts the rule to paths containing the string (a key, or
        ``"/files/"``); ``methods`` to those methods.
        """
        if every < 1 or skip < 0 or (count is not None and count < 0):
            raise ValueError(f"every={every} must be >= 1, skip={skip} >= 0, count={count} None or >= 0")
        rule = Rule(
            Fault(kind), count, skip, every, match,
            frozenset(m.upper() for m in methods) if methods else None, once_per_key, stall_s, retry_after,
        )  # fmt: skip
        with self._lock:
            self._rules.append(rule)
        return rule

    def burst(self, kind: Fault | str, n: int, *, skip: int = 0, match: str | None = None, **kw: object) -> Rule:
        """Fault the next ``n`` matching requests (after letting ``skip`` through: requests skip..skip+n)."""
        return self.add(kind, count=n, skip=skip, match=match, **kw)  # type: ignore[arg-type]

    def always(self, kind: Fault | str, match: str, **kw: object) -> Rule:
        """Fault every request whose path contains ``match``, for good (a permanently broken key)."""
        return self.add(kind, match=match, **kw)  # type: ignore[arg-type]

    def stall(self, every: int, seconds: float, *, match: str | None = None, **kw: object) -> Rule:
        """Delay one matching request in ``every`` by ``seconds`` before forwarding it (stragglers)."""
        return self.add(Fault.STALL, every=every, stall_s=seconds, match=match, **kw)  # type: ignore[arg-type]

    def remove(self, rule: Rule) -> None:
        with self._lock:
            if rule in self._rules:
                self._rules.remove(rule)

    def clear(self) -> None:
        """Remove every rule and bring the proxy up."""
        with self._lock:
            self._rules.clear()
        self.up()

    @property
    def rules(self) -> list[Rule]:
        with self._lock:
            return list(self._rules)

    # -- down ------------------------------------------------------------------------------------
    def down(self, for_s: float | None = None, *, refuse: bool = True) -> None:
        """Go down now, for ``for_s`` seconds or (None) for good. ``refuse``: stop listening (connections
        are refused) and reset open ones; False: keep listening, reset every request."""
        with self._lock:
            self._down_until = float("inf") if for_s is None else time.monotonic() + max(0.0, for_s)
            self._refuse = refuse
        self._notify()

    def up(self) -> None:
        with self._lock:
            was = self._down_until is not None
            self._down_until = None
        if was:
            self._notify()

    def down_state(self, now: float | None = None) -> tuple[bool, bool, float | None]:
        """``(down, refuse, seconds_left)``; ``seconds_left`` is None when down for good or up."""
        now = time.monotonic() if now is None else now
        with self._lock:
            until = self._down_until
            if until is not None and until <= now:
                self._down_until = until = None
            if until is None:
                return False, False, None
            return True, self._refuse, (None if until == float("inf") else until - now)

    def on_change(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (from the changing thread) whenever the down state changes."""
        with self._lock:
            self._listeners.append(fn)

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn()

    # -- the proxy's question ----------------------------------------------------------------------
    def decide(self, method: str, path: str) -> Decision | None:
        """The fault for this request, or None to forward it untouched."""
        if self.down_state()[0]:
            return Decision(Fault.DOWN)
        with self._lock:
            for rule in self._rules:
                if rule.matches(method, path) and rule.fires(path):
                    return Decision(rule.kind, rule.stall_s, rule.retry_after)
        return None


class FaultProxy(LoopService):
    """An HTTP reverse proxy to ``upstream`` that injects the faults of :attr:`schedule`; a context manager.

    Runs its own event loop on a background thread (named ``faultproxy``, so tests that look for
    leftover ``asyncload`` threads do not see it). ``url`` is ``http://127.0.0.1:<free port>``.
    """

    _thread_name = "faultproxy"

    def __init__(
        self,
        upstream: tuple[str, int],
        schedule: FaultSchedule | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        loop: LoopKind = "auto",
        upstream_timeout: float = 60.0,
    ) -> None:
        self.upstream = upstream
        self.schedule = schedule or FaultSchedule()
        self.host = host
        self._want_port = port
        self._loop_kind: LoopKind = loop
        self._upstream_timeout = upstream_timeout
        self._base = f"http://{upstream[0]}:{upstream[1]}"
        self._thread: LoopThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._web: web.Server | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._reopen: asyncio.TimerHandle | None = None
        self._port: int | None = None
        self._counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        self.schedule.on_change(self._schedule_changed)

    # -- facts -----------------------------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("FaultProxy is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def counts(self) -> dict[str, int]:
        """What the proxy did: ``requests`` seen, ``forwarded`` untouched, one entry per :class:`Fault`
        injected, ``upstream_error`` (answered 502 because the upstream failed)."""
        with self._count_lock:
            out = {"requests": 0, "forwarded": 0, "upstream_error": 0} | {f.value: 0 for f in Fault}
            out.update(self._counts)
            return out

    def reset_counts(self) -> None:
        with self._count_lock:
            self._counts.clear()

    def _count(self, what: str) -> None:
        with self._count_lock:
            self._counts[what] += 1

    def __repr__(self) -> str:
        where = self.url if self._port else "not started"
        return f"FaultProxy({where} -> {self._base})"

    # -- on the loop -----------------------------------------------------------------------------------
    async def _open(self) -> None:
        self._loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0)
        timeout = aiohttp.ClientTimeout(total=self._upstream_timeout, sock_connect=5.0)
        self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False)
        # handler_cancellation: a client that gives up (timeout, reset) ends the handler, stalls included.
        self._web = web.Server(self._handle, handler_cancellation=True, access_log=None)
        await self._listen(self._want_port)

    async def _listen(self, port: int) -> None:
        assert self._web is not None and self._loop is not None
        self._listener = await self._loop.create_server(self._web, self.host, port, reuse_address=True, backlog=1024)
        sock = self._listener.sockets[0]
        self._port = sock.getsockname()[1]

    def _schedule_changed(self) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._sync_down)
        except RuntimeError:  # closed between the check and the call
            pass

    def _sync_down(self) -> None:
        """On the loop: make the listener and open connections follow the schedule's down state."""
        assert self._loop is not None
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        down, refuse, left = self.schedule.down_state()
        if down and refuse and self._listener is not None:
            self._listener.close()  # new connections are refused from now on
            self._listener = None
            self._reset_open_connections()
        elif down and not refuse:
            self._reset_open_connections()
        if down and left is not None:
            self._reopen = self._loop.call_later(left + 0.001, self._sync_down)
        if not down and self._listener is None and self._web is not None:
            self._loop.create_task(self._relisten())

    async def _relisten(self) -> None:
        if self._listener is not None:
            return
        try:
            await self._listen(self.port)
        except OSError as exc:  # the port was taken meanwhile: nothing sensible to do but say so
            log.error("faultproxy: cannot listen again on %s:%s: %s", self.host, self._port, exc)

    def _reset_open_connections(self) -> None:
        """A crash, seen from the clients: every open connection gets an RST (requests in flight too)."""
        if self._web is None:
            return
        for handler in self._web.connections:
            _abort_with_rst(handler.transport)

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await self._respond(request)
        except ConnectionError:
            # The client's connection is gone (reset by a fault, or the client gave up). End the handler
            # as aiohttp's handler cancellation does, quietly: an exception would be logged as a 500.
            raise asyncio.CancelledError from None

    async def _respond(self, request: web.BaseRequest) -> web.StreamResponse:
        self._count("requests")
        path = request.raw_path
        decision = self.schedule.decide(request.method, path)
        kind = decision.kind if decision else None
        if kind is Fault.DOWN:
            self._count(Fault.DOWN)
            return await self._drop(request)
        if kind in _S3_ERRORS:
            assert decision is not None
            status, code, message = _S3_ERRORS[kind]
            headers = {"Content-Type": "application/xml"}
            if kind is Fault.HTTP_429:
                headers["Retry-After"] = f"{decision.retry_after:g}"
            self._count(kind)
            return web.Response(
                status=status, body=_s3_error_body(code, message, path.split("?", 1)[0]), headers=headers
            )
        if kind is Fault.HTTP_503:
            self._count(kind)
            return web.Response(status=503, text="Service Unavailable", headers={"Content-Type": "text/plain"})
        if kind is Fault.STALL:
            assert decision is not None
            self._count(kind)  # counted when the stall starts: a cancelled stall was still a straggler
            await asyncio.sleep(decision.stall_s)
        return await self._forward(request, reset_mid_body=kind is Fault.RESET)

    async def _drop(self, request: web.BaseRequest) -> web.StreamResponse:
        """Reset the connection without an answer (there is no response to return: the socket is gone)."""
        _abort_with_rst(request.transport)
        raise ConnectionResetError("faultproxy reset the connection")

    async def _forward(self, request: web.BaseRequest, *, reset_mid_body: bool) -> web.StreamResponse:
        assert self._session is not None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        body = await request.read() if request.body_exists else None  # aiohttp sets its Content-Length
        url = URL(self._base + request.raw_path, encoded=True)
        try:
            up = await self._session.request(
                request.method, url, headers=headers, data=body, allow_redirects=False,
                skip_auto_headers=("Accept-Encoding", "User-Agent", "Content-Type"),
            )  # fmt: skip
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            self._count("upstream_error")
            return web.Response(status=502, text=f"faultproxy: upstream {self._base} failed: {exc}")
        async with up:
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in _HOP:
                    resp.headers.add(k, v)
            if reset_mid_body:
                data = await up.read()
                resp.content_length = len(data)
                await resp.prepare(request)
                await resp.write(data[: max(1, len(data) // 2)])
                await _flushed(request.transport)
                _abort_with_rst(request.transport)
                self._count(Fault.RESET)
                raise ConnectionResetError("faultproxy reset the connection mid-body")
            if up.content_length is not None:
                resp.content_length = up.content_length
            await resp.prepare(request)
            while True:
                try:
                    chunk = await up.content.readany()
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
                    # The upstream broke off mid-body: pass that on as a reset, as a transparent proxy would.
                    self._count("upstream_error")
                    _abort_with_rst(request.transport)
                    raise ConnectionResetError(f"upstream {self._base} broke off mid-body: {exc}") from None
                if not chunk:
                    break
                await resp.write(chunk)  # a client that went away raises ConnectionError: see _handle
            await resp.write_eof()
            self._count("forwarded")
            return resp

    async def _close(self, timeout: float = 2.5) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._web is not None:
            await self._web.shutdown(1.0)
            self._web = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- lifecycle ---------------------------------------------------------------------------------------


def _abort_with_rst(transport: asyncio.BaseTransport | None) -> None:
    """Abort ``transport`` so the peer sees a reset (``SO_LINGER`` 0), not a clean end of stream."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
        except OSError:
            pass
    transport.abort()  # type: ignore[attr-defined]


async def _flushed(transport: asyncio.BaseTransport | None, limit_s: float = 1.0) -> None:
    """Wait until what was written has left the user-space buffer (abort() would drop it), then give the
    peer a moment to read it, so that "part of the body" really reaches the client before the reset."""
    if transport is None:
        return
    end = time.monotonic() + limit_s
    while transport.get_write_buffer_size() and time.monotonic() < end:  # type: ignore[attr-defined]
        await asyncio.sleep(0.001)
    await asyncio.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    """Run a proxy in the foreground until Ctrl-C; print what it did on exit."""
    p = argparse.ArgumentParser(prog="python -m harness.faults", description=__doc__.split("\n")[0])
    p.add_argument("--upstream", required=True, help="HOST:PORT of the real server")
    p.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    p.add_argument("--every", action="append", default=[], metavar="KIND=N", help="fault one request in N with KIND")
    args = p.parse_args(argv)
    host, _, port = args.upstream.rpartition(":")
    proxy = FaultProxy((host or "127.0.0.1", int(port)), port=args.port)
    for spec in args.every:
        kind, _, n = spec.partition("=")
        proxy.schedule.add(Fault(kind), every=int(n or 1))
    with proxy:
        print(f"faultproxy {proxy.url} -> {args.upstream}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
        print(proxy.counts(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["Decision", "Fault", "FaultProxy", "FaultSchedule", "Rule"]
