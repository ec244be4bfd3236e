"""``RequestLog``: a TCP proxy in front of an S3 server that writes down every request and what it cost on
the wire, per client process.

Why it exists: the node block store fetches each row once for a node, yet one node's processes pulled more
from the store than one process did. What the rest is (dataset metadata, chunk headers, version files) is
only seen in the requests themselves: their object keys, their ``Range`` headers and the bytes each answer
took. SeaweedFS writes no such log, so this proxy stands between the clients and its S3 port.

How it attributes and counts:

- **One listening port per label.** A process (a rank, and the reader process it starts, which inherits
  its credentials) is given its own ``endpoint_url`` (``url(label)``), so every request is known by the
  process that sent it without guessing from client ports.
- **Bytes as they crossed the wire.** Each connection's bytes are forwarded untouched; the bytes the server
  sent back between one request and the next on that connection are that request's answer (S3 clients do
  not pipeline: a request is sent once the previous answer is read). So the answers' bytes add up to every
  byte the server sent, headers included: what a counter at the server's port sees.
- **Requests parsed, not rewritten.** A request's line and headers are read as they pass (a request body,
  as a PUT's, is skipped by its ``Content-Length``); nothing is changed, so signatures stay valid.

``entries()`` gives one :class:`Request` per request, in the order they were sent.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from asyncload.runtime.loop import LoopKind, LoopThread

from ._service import LoopService


@dataclass
class Request:
    """One request and its answer as they crossed the wire."""

    label: str  # the listening port's label: which process sent it
    conn: int  # the client connection (one process's)
    method: str
    key: str  # the object key, after the bucket (unquoted); "" for a bucket-level request
    query: str
    range: str | None  # the Range header as sent
    sent: int = 0  # request bytes (line, headers, body)
    status: int = 0
    received: int = 0  # answer bytes, status line and headers included
    length: int | None = None  # the answer's Content-Length


@dataclass
class _Conn:
    """One client connection: the requests it sent whose answers are still coming, and its parse state."""

    label: str
    id: int
    pending: list[Request] = field(default_factory=list)  # sent, answer not finished (the first is current)
    head: bytearray = field(default_factory=bytearray)  # the request head being read
    skip: int = 0  # request body bytes still to pass before the next head
    answering: Request | None = None  # the request the server's bytes are counted against


class RequestLog(LoopService):
    """A logging proxy to ``upstream`` (host, port) with one listening port per label in ``labels``."""

    _thread_name = "s3log"

    def __init__(self, upstream: tuple[str, int], labels: list[str], *, loop: LoopKind = "auto") -> None:
        self.upstream = upstream
        self.labels = list(labels)
        self._loop_kind: LoopKind = loop
        self._thread: LoopThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._servers: list[asyncio.AbstractServer] = []
        self._ports: dict[str, int] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._log: list[Request] = []
        self._tasks: set[asyncio.Task[None]] = set()

    def url(self, label: str) -> str:
        """The endpoint a process labelled ``label`` is given."""
        return f"http://127.0.0.1:{self._ports[label]}"

    def entries(self) -> list[Request]:
        """Every request seen so far, in the order they were sent."""
        with self._lock:
            return list(self._log)

    def clear(self) -> None:
        with self._lock:
            self._log.clear()

    # -- on the loop ---------------------------------------------------------------------------------
    async def _open(self) -> None:
        self._loop = asyncio.get_running_loop()
        for label in self.labels:
            server = await asyncio.start_server(
                lambda r, w, label=label: self._serve(label, r, w), "127.0.0.1", 0, backlog=1024
            )
            self._servers.append(server)
            self._ports[label] = server.sockets[0].getsockname()[1]

    async def _close(self, timeout: float) -> None:
        for s in self._servers:
            s.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)

    async def _serve(self, label: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        conn = _Conn(label, next(self._ids))
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            self._tasks.discard(task)
            return
        try:
            await asyncio.gather(self._pump_up(conn, reader, up_w), self._pump_down(conn, up_r, writer))
        except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # (a cancel is the proxy closing: asyncio's stream callback would log it as an error)
        finally:
            for w in (writer, up_w):
                w.close()
            self._tasks.discard(task)

    async def _pump_up(self, conn: _Conn, reader: asyncio.StreamReader, up: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            self._requests(conn, data)
            up.write(data)
            await up.drain()
        up.write_eof()

    async def _pump_down(self, conn: _Conn, up: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await up.read(1 << 16):
            self._answers(conn, data)
            writer.write(data)
            await writer.drain()
        writer.close()

    # -- parsing -------------------------------------------------------------------------------------
    def _requests(self, conn: _Conn, data: bytes) -> None:
        """Read request heads out of the client's bytes; count every byte to the request it belongs to."""
        view = memoryview(data)
        while view:
            if conn.skip:  # a request body: passed, counted to its request
                n = min(conn.skip, len(view))
                conn.skip -= n
                if conn.pending:
                    conn.pending[-1].sent += n
                view = view[n:]
                continue
            conn.head += view
            view = view[len(view) :]
            end = conn.head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, rest = bytes(conn.head[: end + 4]), bytes(conn.head[end + 4 :])
            conn.head.clear()
            req = _parse_request(conn, head)
            conn.skip = _length(head) or 0
            with self._lock:
                self._log.append(req)
                conn.pending.append(req)
            view = memoryview(rest)

    def _answers(self, conn: _Conn, data: bytes) -> None:
        """Count the server's bytes to the request they answer: a new status line starts the next answer."""
        with self._lock:
            if data.startswith(b"HTTP/1.") and conn.pending and (conn.answering is None or conn.answering.received):
                if conn.answering is not None and conn.answering in conn.pending:
                    conn.pending.remove(conn.answering)
                req = conn.answering = conn.pending[0]
                line = data.split(b"\r\n", 1)[0].split()
                req.status = int(line[1]) if len(line) > 1 and line[1].isdigit() else 0
                end = data.find(b"\r\n\r\n")
                req.length = _length(data[: end + 4]) if end >= 0 else None
            if conn.answering is not None:
                conn.answering.received += len(data)


def _parse_request(conn: _Conn, head: bytes) -> Request:
    line, *_ = head.split(b"\r\n", 1)
    method, target, *_ = line.decode("latin-1").split(" ")
    parts = urlsplit(target)
    path = unquote(parts.path).lstrip("/")
    key = path.split("/", 1)[1] if "/" in path else ""
    rng = None
    for h in head.split(b"\r\n")[1:]:
        name, _, value = h.partition(b":")
        if name.strip().lower() == b"range":
            rng = value.strip().decode("latin-1")
    return Request(conn.label, conn.id, method, key, parts.query, rng, sent=len(head))


def _length(head: bytes) -> int | None:
    for h in head.split(b"\r\n")[1:]:
        name, _, value = h.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return None


__all__ = ["Request", "RequestLog"]
