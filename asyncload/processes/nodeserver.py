"""The node's shared Deep Lake reader itself (``nodereader`` is the loader's side, and says why): a process
that listens on ``<root>/readers/reader-<code tag>.sock`` (one per build of asyncload), admits this user's
processes that hold the user's key, and reads for each what it asks, as a loader's own reader process does
(``isolated``), in the same frames.
Loaders that send the same pickled source share one opened handle, closed once its last loader has left and
its reads have ended. It exits once its last loader has left.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import importlib
import logging
import os
import pickle
import queue
import select
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

from ..runtime.loop import LoopThread, start_thread
from .nodereader import NodeUnavailable, _key, _peer, held, lock_name

log = logging.getLogger("asyncload")

#: Seconds the server waits for the next loader once the last has left, before it exits (none: a loader keeps
#: its connection across its epochs; a loader that comes as the server stops starts the next one).
IDLE_S = 0.0
#: Seconds it waits for its first loader (the one that started it connects at once).
FIRST_IDLE_S = 30.0


@dataclass
class _Shared:
    """One source the server reads for every loader that sent it."""

    source: Any
    #: the clients reading through it now, each with what its last ``configure`` said (None before one)
    clients: dict[int, tuple[int, int | None] | None] = field(default_factory=dict)
    #: its reads in flight, those of loaders that left included: a Deep Lake read is never left running
    reads: set[concurrent.futures.Future[Any]] = field(default_factory=set)
    #: what its open said, sent to each loader it is given (``isolated.open_described``)
    described: Any = None


def _names(source: Any) -> str | None:
    """What names the bytes behind an opened source's rows (``Source.store_key``), None where unknown."""
    try:
        key = source.store_key
    except Exception:  # noqa: BLE001 - an open that failed: nothing to share
        return None
    return key if isinstance(key, str) else None


class _Server:
    def __init__(self, dfd: int, sock: socket.socket, name: str, key: bytes) -> None:
        self.key = key
        self.dfd = dfd
        self.sock = sock  # bound and listening already (``nodereader._start``)
        self.name = name  # its name in the readers directory (``nodereader.socket_name``)
        self.inode = os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ino  # (to remove it only if ours)
        self.lock = threading.Lock()
        self.clients = 0
        self.left_at = time.monotonic() + FIRST_IDLE_S - IDLE_S  # no loader yet: wait longer for the first
        self.sources: dict[str, _Shared] = {}  # the shared handle of each source (pickled bytes' digest)
        self.opening: dict[str, threading.Lock] = {}
        self.opened: list[_Shared] = []  # every handle open, closed once unused (``_close_unused``) or at exit
        self.lt = LoopThread("asyncload-node-reader-loop", cpu_workers=1)
        self.lt.start()
        self.next_id = 0

    def serve(self) -> None:
        """Accept loaders until the last has left and none came for ``IDLE_S``; then stop."""
        while True:
            readable, _, _ = select.select([self.sock], [], [], 0.05)
            with self.lock:
                idle = not readable and not self.clients and time.monotonic() - self.left_at >= IDLE_S
            if idle and self._stopped():
                break
            self._close_unused()
            if not readable:
                continue
            try:
                raw, _ = self.sock.accept()
            except OSError:
                continue
            with self.lock:  # counted now, so that the loop does not stop under a loader being admitted
                self.clients += 1
            start_thread(self._admit, raw, name="asyncload-node-reader-client")
        # never leave a Deep Lake read running
        concurrent.futures.wait([f for shared in self.opened for f in list(shared.reads)], timeout=30)
        self.lt.stop()
        for shared in self.opened:
            with contextlib.suppress(Exception):
                shared.source.close()

    def _close_unused(self) -> None:
        """Close the handles no loader reads through any more, once their last reads have ended: a server that
        outlives many loaders (one kept for the job, others made and closed each epoch) holds only the
        handles in use. A handle still named in ``sources`` is kept: a loader may be being given it."""
        with self.lock:
            named = {id(s) for s in self.sources.values()}
            unused = [s for s in self.opened if not s.clients and not s.reads and id(s) not in named]
            if not unused:
                return
            self.opened = [s for s in self.opened if s not in unused]
        for shared in unused:
            with contextlib.suppress(Exception):
                shared.source.close()

    def _stopped(self) -> bool:
        """Stop listening unless a loader is queued on the socket: under the node's start lock, which a loader
        holds from its connect on (``nodereader.launch``), so that a loader either queued before this last look
        (and is served) or finds no socket and starts the next server. A listener closed with a loader queued
        would reset it (``ConnectionResetError`` in its handshake: it read in a process of its own). The lock
        is only tried: where a loader holds it, that loader is connecting, and is served first (waiting for
        it here could wait on a loader whose connect waits for this server's accept, the backlog full). The
        socket's name is removed only if it is still ours, as a check (only this server listens on it).
        Where the lock cannot be had at all (the node's directory removed under the server, as by a job's
        clean-up of its cache directory: no loader can find the socket then), it stops without it."""
        try:
            with held(self.dfd, lock_name(self.name), wait=False):
                if select.select([self.sock], [], [], 0)[0]:
                    return False
                self._unlisten()
        except BlockingIOError:
            return False
        except OSError:
            self._unlisten()
        return True

    def _unlisten(self) -> None:
        """Close the listener and remove the socket's name, if it is still this server's."""
        self.sock.close()
        with contextlib.suppress(OSError):
            if os.stat(self.name, dir_fd=self.dfd, follow_symlinks=False).st_ino == self.inode:
                os.unlink(self.name, dir_fd=self.dfd)

    def _admit(self, raw: socket.socket) -> None:
        """A new connection: the peer must be this user's and hold the key (both ways) before anything it
        sends is unpickled; then it is served until it leaves."""
        with self.lock:
            self.next_id += 1
            me = self.next_id
        conn = Connection(raw.detach())
        try:
            _, uid = _peer(conn.fileno())
            if uid != os.getuid():
                return
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            conn.send_bytes(str(os.getpid()).encode())  # (``nodereader.handshake``)
            self._serve_client(me, conn)
        except (OSError, EOFError):  # it hung up
            pass
        except Exception as exc:  # noqa: BLE001 - one loader's failure is its own
            log.warning("asyncload: the node's reader dropped a loader: %s: %s", type(exc).__name__, str(exc))
        finally:
            conn.close()
            with self.lock:
                self.clients -= 1
                if not self.clients:
                    self.left_at = time.monotonic()

    def _shared(self, me: int, module: str, payload: bytes, path: list[str]) -> _Shared:
        """The opened source these pickled bytes describe, shared by every loader that sends the same bytes
        while it is in use. A loader that comes while others read through it is given it only if it still
        names the bytes this loader's own open saw (``Source.store_key``: the URL, the dataset's identity,
        its version): a dataset that took a commit, or was made again at its URL, since the shared handle
        was opened gets a handle of its own, opened now. ``path``: the loader's ``sys.path``, whose entries
        this process lacks are added (as ``multiprocessing``'s spawn gives a child its parent's), so that
        its module imports here."""
        from .isolated import open_described

        digest = hashlib.sha256(payload).hexdigest()
        with self.lock:
            sys.path.extend(p for p in path if isinstance(p, str) and p not in sys.path)
            opening = self.opening.setdefault(digest, threading.Lock())
        importlib.import_module(module)
        with opening:  # one open at a time per source
            with self.lock:
                known = self.sources.get(digest)
            fresh = pickle.loads(payload)
            described = open_described(fresh)
            alike = known is not None and _names(known.source) == _names(fresh) is not None
            with self.lock:  # ``known`` only while a loader still reads through it: else it is being closed
                if known is not None and alike and known.clients and self.sources.get(digest) is known:
                    chosen = known
                else:
                    chosen = self.sources[digest] = _Shared(fresh, described=described)
                    self.opened.append(chosen)
                chosen.clients[me] = None
            if chosen is known:
                with contextlib.suppress(Exception):
                    fresh.close()
        return chosen

    def _serve_client(self, me: int, conn: Connection) -> None:
        from .isolated import _send_all, _serve_requests  # (here: the server listens before it imports them)

        msg = conn.recv()
        if not (isinstance(msg, tuple) and len(msg) == 4 and msg[0] == "source"):
            return
        _, module, payload, path = msg
        out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        sender = start_thread(_send_all, conn, out, name="asyncload-node-reader-send")
        try:
            try:
                shared = self._shared(me, module, payload, path)
            except Exception as exc:  # noqa: BLE001 - said to that loader, which reads in a reader of its own
                out.put(("refused", 0, f"{type(exc).__name__}: {exc}", (0, 0)))
                return
            out.put(("ready", 0, None, (0, 0)))  # (the loader's reads queued meanwhile)
            if shared.described is not None:
                out.put(("opened", 0, shared.described, (0, 0)))
            configure = functools.partial(self._configure, shared, me)
            _serve_requests(conn, shared.source, self.lt, out, shared.reads, configure)
        finally:
            with self.lock:
                if "shared" in locals():
                    shared.clients.pop(me, None)
                    if not shared.clients:  # the next loader opens it afresh (this one closes: ``_close_unused``)
                        for digest in [d for d, s in self.sources.items() if s is shared]:
                            del self.sources[digest]
            out.put(None)
            sender.join(5)

    def _configure(self, shared: _Shared, me: int, requests: int, samples: int | None) -> None:
        """The source is sized for every loader it serves: the sum of what each keeps in flight."""
        with self.lock:
            shared.clients[me] = (requests, samples)
            said = [c for c in shared.clients.values() if c is not None]
            total_r = sum(r for r, _ in said)
            sized = [s for _, s in said]
            total_s = None if any(s is None for s in sized) else sum(s for s in sized if s is not None)
        shared.source.configure(total_r, total_s)


def _early_import(module: str) -> None:
    """Import the first loader's source module (Deep Lake) now, while that loader checks its bucket and opens
    its dataset; its source, when it comes, imports it again (``_shared``), then without the wait or the error."""
    with contextlib.suppress(Exception):
        importlib.import_module(module)


def server_main() -> None:
    """The server's entry (``python -c``): ``argv[1]`` is the readers directory, ``argv[2]`` the module to
    import at once, ``argv[3]`` the listening socket the loader that started it made (``nodereader._start``),
    ``argv[4]`` that socket's name there."""
    from ..runtime.procs import run_child

    run_child(dict(os.environ), _serve, sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])


def _serve(where: str, module: str, fd: int, name: str) -> None:
    """Serve the node's loaders on the socket ``fd`` (bound and listening in ``where`` as ``name``), the first
    loader's source module imported at once, until the last loader has left."""
    sock = socket.socket(fileno=fd)
    dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    st = os.fstat(dfd)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:  # (the loader made it so: ``readers_dir``)
        raise NodeUnavailable(f"{where} is not this user's private directory")
    server = _Server(dfd, sock, name, _key())
    if module != "__main__":
        start_thread(_early_import, module, name="asyncload-node-reader-import")
    server.serve()
