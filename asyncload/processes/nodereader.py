"""One Deep Lake reader process per node, shared by every loader on it: what makes a node's ranks, DataLoader
workers and their reads pull Deep Lake's pages once.

Why: the node store makes every row one fetch per node, yet 4 ranks of one node pulled 1.16-1.32x one
process's bytes (benchmarks/results/partition/per_process_reads.md). Deep Lake 4.7.4 fetches rows in pages of
up to 128 KiB and keeps them in the process that read them; each process that needs a row of a page it does
not hold fetches the whole page again, and each opens the dataset and reads every data file's first 32 KiB
for itself. One reader for the node holds them once.

How: the first loader of a node (a node is the node store's root, ``cache_dir``) that needs a reader binds
and listens on ``<root>/readers/reader-<code tag>.sock`` (``code_tag``: one server per build of asyncload)
and starts the server with that socket (``nodeserver``: this module is the loader's side); every loader
connects at once (``launch``) and completes the connection once it has opened its own handle
(``handshake``), so that no loader waits for the server's start. The socket lives in the store's private
directory (``nodestore.root``: the user's, 0700), each side proves it holds the user's key
(``nodestore.values.user_key``, the challenge of ``multiprocessing.connection``, both ways) and the server
checks its peer's uid (``SO_PEERCRED``) before anything is unpickled. A loader then speaks to it as to its
own reader process (``isolated``): its source first, then reads, answered in the same frames. Loaders that
send the same source (the same pickled bytes: one dataset, one selection, one set of keys) share one opened
handle, and so Deep Lake's pages.

What it does not change: a loader that loses the node's reader (it died, or was killed stuck) handles that as
the death of its own reader (``isolated``: reads in flight read again, alone, in a reader process of its own)
and keeps that private reader for its life, so that crash narrowing names the right rows whatever the other
loaders send (a DataLoader worker, which may not start children, reads in itself from then on, as workers
without the node's reader do). The server is this module's only process that is no ``multiprocessing`` child:
started with ``subprocess``, so that a daemonic DataLoader worker may start it and its end is not tied to the
loader that started it. It exits once its last loader has left.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from pathlib import Path

from ..runtime.loop import start_thread

log = logging.getLogger("asyncload")

#: The package this process runs: the server a loader starts runs it too (``_start``).
PACKAGE = Path(__file__).resolve().parents[1]


@functools.cache
def code_tag() -> str:
    """A digest of the asyncload code this process runs (every module of the package, by content): part of the
    socket's and the lock's names, so that a loader only ever meets a server that runs its own code. A node
    where two jobs run two builds of asyncload (an upgrade while an older job still reads, two checkouts)
    then has one server per build; one server for both would unpickle one build's sources and send frames
    the other cannot read."""
    h = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(path.relative_to(PACKAGE).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def socket_name() -> str:
    return f"reader-{code_tag()}.sock"


def lock_name(sock: str | None = None) -> str:
    """The start lock of the server on socket ``sock`` (this build's by default): ``held`` by a loader from its
    connect to the start of a server, and by a server from its last look for a queued loader to the removal of
    its socket."""
    return (sock or socket_name()).removesuffix(".sock") + ".lock"


@contextlib.contextmanager
def held(dfd: int, name: str, *, wait: bool = True) -> Iterator[None]:
    """The lock file ``name`` in the readers directory ``dfd``, held (``flock``) for the block: released at
    its end, and by the kernel if the holder dies. ``wait=False``: ``BlockingIOError`` at once where another
    process holds it."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)  # (releases the lock)


#: Seconds a loader waits for a new server's first word (an interpreter and its imports: ~0.2 s) before it
#: reads in a reader of its own.
START_S = 30.0


class NodeUnavailable(RuntimeError):
    """The node's reader cannot be reached or started here: the loader reads in a process of its own.
    ``said``: the node store says why itself (its directory cannot be used), so this need not warn too."""

    def __init__(self, message: str, *, said: bool = False) -> None:
        super().__init__(message)
        self.said = said


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
    return f"/proc/self/fd/{dfd}/{socket_name()}"


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

    def leave(self) -> tuple[int, None]:
        """This loader is done with it (it serves the others, and exits after the last); ``(pid, None)``, as
        ``reap`` gives them (no exit code: it lives on)."""
        fd, self.pidfd = self.pidfd, None
        if fd is not None:
            os.close(fd)
        return self.pid, None


@dataclass
class Launch:
    """A connection to the node's reader made, not yet authenticated (``handshake``): the socket, and the
    server's ``Popen`` where this process started it."""

    sock: socket.socket
    popen: subprocess.Popen[bytes] | None

    def close(self) -> None:
        self.sock.close()


def launch(root: Path, module: str = "deeplake") -> Launch:
    """Connect to the node's reader under ``root``, starting it where none listens, without waiting for it:
    a new server's socket is bound and listening here, under the start lock (``lock_name``), before the server
    starts (it is handed the socket), so that every loader of the node connects at once and one server is ever
    started. A server stops under that lock too (``nodeserver``), after a last look for a loader queued on its
    socket: a loader either connects before that look and is served, or finds no socket and starts the next
    server. ``handshake`` then waits for the server, once this loader has done its own open meanwhile.
    ``module``: what a server started here imports at once (the source's ``reader_module``)."""
    try:
        dfd = readers_dir(root)
    except OSError as exc:
        raise NodeUnavailable(f"{root}/readers: {exc}", said=True) from exc
    try:
        with held(dfd, lock_name()):
            sock, popen = _connect(dfd), None
            if sock is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(socket_name(), dir_fd=dfd)  # a server that died without removing it
                popen = _start(dfd, root / "readers", module)
                sock = _connect(dfd)
                if sock is None:
                    raise NodeUnavailable(f"the node's reader (pid {popen.pid}) refused a connection")
    finally:
        os.close(dfd)
    return Launch(sock, popen)


def handshake(got: Launch) -> tuple[Connection, NodeReader]:
    """Prove the user's key to the server and have it prove its own (the challenge of
    ``multiprocessing.connection``, both ways), and check its uid: the connection, and the server as a
    ``NodeReader``. Waits for a server still starting (its imports, ~0.2 s)."""
    key = _key()
    conn = Connection(got.sock.detach())
    try:
        if not conn.poll(START_S):  # its challenge comes first: a server that never starts is no reader
            raise TimeoutError(f"no challenge within {START_S:.0f} s")
        answer_challenge(conn, key)
        deliver_challenge(conn, key)
        # Its pid as it says (it holds the key now): the kernel's record of the listening socket names the
        # process that made it listen, which is the loader that started the server (``_start``).
        pid = int(conn.recv_bytes(32))
        _, uid = _peer(conn.fileno())
    except (
        OSError,
        EOFError,
        ValueError,
        AuthenticationError,
        TimeoutError,
    ) as exc:  # a server that died as we came, or another key
        conn.close()
        raise NodeUnavailable(f"the node's reader did not accept this loader: {type(exc).__name__}: {exc}") from exc
    if uid != os.getuid():  # in a private directory only the user or root could listen: refuse root too
        conn.close()
        raise NodeUnavailable(f"the node's reader socket is served by uid {uid}, not this user's")
    popen = got.popen
    return conn, NodeReader(pid, popen if popen is not None and popen.pid == pid else None)


def connect(root: Path, module: str = "deeplake") -> tuple[Connection, NodeReader]:
    """``launch`` and ``handshake`` in one: a connection to the node's reader, ready."""
    return handshake(launch(root, module))


def _connect(dfd: int) -> socket.socket | None:
    """A socket connected to the server that listens, or None where none does."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(_address(dfd))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return sock


def _start(dfd: int, where: Path, module: str) -> subprocess.Popen[bytes]:
    """Bind and listen on the node's socket here, then start the server with it (it accepts what queued
    meanwhile). Its environment is this process's, with one BLAS thread (``runtime.procs``: numpy's threads
    would spin in a process that does no linear algebra); it stays in this job's process group, so that what
    ends the job ends it."""
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listening.bind(_address(dfd))
        listening.listen(64)
        env = dict(os.environ, **{v: os.environ.get(v, "1") for v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
        # This process's asyncload first on the server's path, whatever its working directory or the
        # environment would import instead: it serves this code's socket (``code_tag``).
        code = (
            f"import sys; sys.path.insert(0, {str(PACKAGE.parent)!r}); "
            "from asyncload.processes.nodeserver import server_main; server_main()"
        )
        fd = listening.fileno()
        popen = subprocess.Popen([sys.executable, "-c", code, str(where), module, str(fd), socket_name()],
                                 stdin=subprocess.DEVNULL, env=env, close_fds=True, pass_fds=(fd,))  # fmt: skip
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(socket_name(), dir_fd=dfd)
        raise NodeUnavailable(f"the node's reader could not be started: {type(exc).__name__}: {exc}") from exc
    finally:
        listening.close()  # (the server holds it now)
    start_thread(popen.wait, name="asyncload-node-reader-reap")  # a child of ours: never left a zombie
    return popen
