"""One Deep Lake reader process per node, shared by every loader on it: what makes a node's ranks, DataLoader
workers and their reads pull Deep Lake's pages once.

Why: the node store makes every row one fetch per node, yet 4 ranks of one node pulled 1.16-1.32x one
process's bytes (benchmarks/results/partition/per_process_reads.md). Deep Lake 4.7.4 fetches rows in pages of
up to 128 KiB and keeps them in the process that read them; each process that needs a row of a page it does
not hold fetches the whole page again, and each opens the dataset and reads every data file's first 32 KiB
for itself. One reader for the node holds them once.

How: the first loader of a node (a node is the node store's root, ``cache_dir``) that needs a reader starts
one, ``python -c "...nodereader import main"``, which listens on ``<root>/readers/reader.sock``; every later
loader connects to it. The socket lives in the store's private directory (``nodestore.root``: the user's,
0700), each side proves it holds the user's key (``nodestore.values.user_key``, the challenge of
``multiprocessing.connection``, both ways) and the server checks its peer's uid (``SO_PEERCRED``) before
anything is unpickled. A loader then speaks to it as to its own reader process (``isolated``): its source
first, then reads, answered in the same frames. Loaders that send the same source (the same pickled bytes:
one dataset, one selection, one set of keys) share one opened handle, and so Deep Lake's pages.

What it does not change: a loader that loses the node's reader (it died, or was killed stuck) handles that as
the death of its own reader (``isolated``: reads in flight read again, alone, in a reader process of its own)
and keeps that private reader for its life, so that crash narrowing names the right rows whatever the other
loaders send. The server exits once its last loader has left (and after ``IDLE_S`` without one).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import functools
import hashlib
import importlib
import logging
import os
import pickle
import queue
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from ..runtime.loop import LoopThread, start_thread
from ..runtime.procs import run_child

log = logging.getLogger("asyncload")

SOCKET = "reader.sock"
LOCK = "reader.lock"
#: Seconds a new server may take to listen (an interpreter and asyncload's imports, ~0.2 s; Deep Lake is
#: imported later, while the first loader checks its bucket).
START_S = 30.0
#: Seconds the server waits for a first loader, or for the next one once the last has left, before it exits.
IDLE_S = 0.0
_FIRST_IDLE_S = 30.0


class NodeUnavailable(RuntimeError):
    """The node's reader cannot be reached or started here: the loader reads in a process of its own."""


def readers_dir(root: Path) -> int:
    """A descriptor of ``<root>/readers``: the node store's root checked private (``nodestore.root``)."""
    from ..nodestore.root import open_root, sub_dir

    top = open_root(root)
    try:
        return sub_dir(top, "readers", root / "readers")
    finally:
        os.close(top)


def _address(dfd: int) -> str:
    """The socket's path through this process's descriptor of its directory: short whatever the root's
    length (an AF_UNIX path has 108 bytes), and never through a name another user could have replaced."""
    return f"/proc/self/fd/{dfd}/{SOCKET}"


def _peer(sock_fd: int) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket, as the kernel recorded it."""
    with socket.socket(fileno=os.dup(sock_fd)) as s:
        pid, uid, _ = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _key() -> bytes:
    from ..nodestore.values import user_key

    key = user_key()
    if key is None:
        raise NodeUnavailable("the user's key (nodestore.values.key_path) cannot be read or made")
    return key


# -- the loader's side ------------------------------------------------------------------------------------
@dataclass
class NodeReader:
    """The node's reader as a loader holds it: its pid (from the kernel, at connect), a pidfd to watch and
    kill it without a pid reused, and the ``Popen`` where this process started it (to reap it)."""

    pid: int
    popen: subprocess.Popen[bytes] | None = None
    pidfd: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.pidfd = os.pidfd_open(self.pid)

    def kill(self) -> None:
        """SIGKILL it (stuck: every loader of the node then reads in a reader of its own)."""
        with contextlib.suppress(OSError):
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)

    def _gone(self, timeout: float) -> bool:
        if self.pidfd is None:
            return False
        readable, _, _ = select.select([self.pidfd], [], [], timeout)
        return bool(readable)

    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        """After its connection broke: wait a second for its end (killed if it lives on: it broke the
        connection without dying), release the pidfd; ``(pid, exitcode)``, the exit code only where this
        process started it (another loader's child is reaped by that loader)."""
        if not self._gone(1.0):
            self.kill()
            self._gone(timeout)
        code = None
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.popen.wait(timeout)
        self.leave()
        return self.pid, code

    def leave(self) -> None:
        """This loader is done with it (it serves the others, and exits after the last)."""
        fd, self.pidfd = self.pidfd, None
        if fd is not None:
            os.close(fd)


def connect(root: Path) -> tuple[Connection, NodeReader]:
    """A connection to the node's reader under ``root``, started here if none listens (one start per node:
    the connect and the start are one step under ``reader.lock``)."""
    key = _key()
    try:
        dfd = readers_dir(root)
    except OSError as exc:
        raise NodeUnavailable(f"{root}/readers: {exc}") from exc
    try:
        lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            popen = None
            conn = _dial(dfd, key)
            if conn is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(SOCKET, dir_fd=dfd)  # a server that died without removing it
                popen = _start(root / "readers")
                conn = _dial(dfd, key)
                if conn is None:
                    raise NodeUnavailable(f"the node's reader (pid {popen.pid}) listens, yet refused a connection")
        finally:
            os.close(lock)  # (releases the lock)
    finally:
        os.close(dfd)
    pid, uid = _peer(conn.fileno())
    if uid != os.getuid():  # in a private directory only the user or root could listen: refuse root too
        conn.close()
        raise NodeUnavailable(f"the node's reader socket under {root} is served by uid {uid}, not this user's")
    return conn, NodeReader(pid, popen if popen is not None and popen.pid == pid else None)


def _dial(dfd: int, key: bytes) -> Connection | None:
    try:
        return Client(_address(dfd), family="AF_UNIX", authkey=key)
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except (OSError, EOFError) as exc:  # a server stopping as we came, or a failed challenge
        raise NodeUnavailable(f"the node's reader did not accept this loader: {type(exc).__name__}: {exc}") from exc


def _start(where: Path) -> subprocess.Popen[bytes]:
    """Start the server and wait until it listens (its first line on stdout). Its environment is this
    process's, with one BLAS thread (``runtime.procs``: numpy's threads would spin in a process that does
    no linear algebra); it stays in this job's process group, so that what ends the job ends it."""
    env = dict(os.environ, **{v: os.environ.get(v, "1") for v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    code = "from asyncload.processes.nodereader import main; main()"
    popen = subprocess.Popen([sys.executable, "-c", code, str(where)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, env=env, close_fds=True)  # fmt: skip
    assert popen.stdout is not None
    readable, _, _ = select.select([popen.stdout], [], [], START_S)
    line = popen.stdout.readline() if readable else b""
    popen.stdout.close()
    if line.strip() != b"listening":
        with contextlib.suppress(OSError):
            popen.kill()
        code_ = popen.wait()
        raise NodeUnavailable(f"the node's reader did not start (exit code {code_}; its error is on stderr)")
    start_thread(popen.wait, name="asyncload-node-reader-reap")  # a child of ours: never left a zombie
    return popen


# -- the server -----------------------------------------------------------------------------------------
@dataclass
class _Shared:
    """One source the server reads for every loader that sent it."""

    source: Any
    opened: threading.Lock = field(default_factory=threading.Lock)
    is_open: bool = False
    clients: dict[int, tuple[int, int | None]] = field(default_factory=dict)  # client → its configure()


class _Server:
    def __init__(self, dfd: int, key: bytes) -> None:
        self.key = key
        self.dfd = dfd
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(_address(dfd))
        self.inode = os.stat(SOCKET, dir_fd=dfd, follow_symlinks=False).st_ino
        self.sock.listen(64)
        self.lock = threading.Lock()
        self.clients = 0
        self.stopping = False
        self.left_at = time.monotonic() + _FIRST_IDLE_S - IDLE_S  # no loader yet: wait longer for the first
        self.sources: dict[str, _Shared] = {}
        self.pending: set[concurrent.futures.Future[Any]] = set()
        self.lt = LoopThread("asyncload-node-reader-loop", cpu_workers=1)
        self.lt.start()
        self.next_id = 0

    def serve(self) -> None:
        """Accept loaders until the last has left and none came for ``IDLE_S``; then stop."""
        while True:
            readable, _, _ = select.select([self.sock], [], [], 0.05)
            with self.lock:
                if not readable and not self.clients and time.monotonic() - self.left_at >= IDLE_S:
                    self.stopping = True  # (under the lock: a loader accepted from now on is refused)
                    break
            if not readable:
                continue
            try:
                raw, _ = self.sock.accept()
            except OSError:
                continue
            start_thread(self._admit, raw, name="asyncload-node-reader-client")
        self._close_listener()
        concurrent.futures.wait(list(self.pending), timeout=30)  # never leave a Deep Lake read running
        self.lt.stop()
        for shared in self.sources.values():
            with contextlib.suppress(Exception):
                shared.source.close()

    def _close_listener(self) -> None:
        """Stop listening; remove the socket's name only if it is still ours (a loader may already have
        started the next server on that name)."""
        self.sock.close()
        with contextlib.suppress(OSError):
            if os.stat(SOCKET, dir_fd=self.dfd, follow_symlinks=False).st_ino == self.inode:
                os.unlink(SOCKET, dir_fd=self.dfd)

    def _admit(self, raw: socket.socket) -> None:
        """A new connection: the peer must be this user's and hold the key (both ways) before anything it
        sends is unpickled; then it is served until it leaves."""
        with self.lock:
            if self.stopping:
                raw.close()
                return
            self.clients += 1
            self.next_id += 1
            me = self.next_id
        conn = Connection(raw.detach())
        try:
            _, uid = _peer(conn.fileno())
            if uid != os.getuid():
                return
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
            self._serve_client(me, conn)
        except (OSError, EOFError, Exception) as exc:  # noqa: BLE001 - one loader's failure is its own
            if not isinstance(exc, (OSError, EOFError)):
                log.warning("asyncload: the node's reader dropped a loader: %s: %s", type(exc).__name__, exc)
        finally:
            conn.close()
            with self.lock:
                self.clients -= 1
                if not self.clients:
                    self.left_at = time.monotonic()

    def _shared(self, module: str, payload: bytes, path: list[str]) -> _Shared:
        """The source these pickled bytes describe, unpickled once and opened once for every loader that
        sends the same bytes. ``path``: the loader's ``sys.path``, whose entries this process lacks are
        added (as ``multiprocessing``'s spawn gives a child its parent's), so that its module imports here."""
        digest = hashlib.sha256(payload).hexdigest()
        with self.lock:
            shared = self.sources.get(digest)
        if shared is None:
            with self.lock:
                sys.path.extend(p for p in path if isinstance(p, str) and p not in sys.path)
            importlib.import_module(module)
            source = pickle.loads(payload)
            with self.lock:
                shared = self.sources.setdefault(digest, _Shared(source))
        with shared.opened:
            if not shared.is_open:
                shared.is_open = True
                with contextlib.suppress(Exception):  # a failure here is each read's to raise
                    shared.source.open()
        return shared

    def _serve_client(self, me: int, conn: Connection) -> None:
        from .isolated import _answer, _send_all

        msg = conn.recv()
        if not (isinstance(msg, tuple) and len(msg) == 4 and msg[0] == "source"):
            return
        _, module, payload, path = msg
        out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        sender = start_thread(_send_all, conn, out, name="asyncload-node-reader-send")
        try:
            shared = self._shared(module, payload, path)
            out.put(("ready", 0, None, (0, 0)))
            source = shared.source
            while True:
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
                if msg is None:
                    break
                if msg[0] == "configure":
                    self._configure(shared, me, msg[1], msg[2])
                    continue
                if msg[0] == "stall_timeout":
                    source.set_stall_timeout(msg[1])
                    continue
                _, rid, indices, raw = msg
                f = self.lt.submit(source.read(indices, raw))
                with self.lock:
                    self.pending.add(f)
                f.add_done_callback(self._done)
                f.add_done_callback(functools.partial(_answer, out, source, rid))
        finally:
            with self.lock:
                if "shared" in locals():
                    shared.clients.pop(me, None)
            out.put(None)
            sender.join(5)

    def _done(self, f: concurrent.futures.Future[Any]) -> None:
        with self.lock:
            self.pending.discard(f)

    def _configure(self, shared: _Shared, me: int, requests: int, samples: int | None) -> None:
        """The source is sized for every loader it serves: the sum of what each keeps in flight."""
        with self.lock:
            shared.clients[me] = (requests, samples)
            total_r = sum(r for r, _ in shared.clients.values())
            sized = [s for _, s in shared.clients.values()]
            total_s = None if any(s is None for s in sized) else sum(s for s in sized if s is not None)
        shared.source.configure(total_r, total_s)


def _serve(where: str) -> None:
    try:
        dfd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        st = os.fstat(dfd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:  # (the loader made it so: ``readers_dir``)
            raise NodeUnavailable(f"{where} is not this user's private directory")
        server = _Server(dfd, _key())
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        return  # another server took the name first: the loader that started this one connects to that
    os.write(1, b"listening\n")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the loader that waited has read its line
    server.serve()


def main() -> None:
    """The server's entry (``python -c``): ``argv[1]`` is the readers directory."""
    run_child(dict(os.environ), _serve, sys.argv[1])
