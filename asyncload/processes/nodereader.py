"""One Deep Lake reader process per node, shared by every loader on it: what makes a node's ranks, DataLoader
workers and their reads pull Deep Lake's pages once.

Why: the node store makes every row one fetch per node, yet 4 ranks of one node pulled 1.16-1.32x one
process's bytes (benchmarks/results/partition/per_process_reads.md). Deep Lake 4.7.4 fetches rows in pages of
up to 128 KiB and keeps them in the process that read them; each process that needs a row of a page it does
not hold fetches the whole page again, and each opens the dataset and reads every data file's first 32 KiB
for itself. One reader for the node holds them once.

How: the first loader of a node (a node is the node store's root, ``cache_dir``) that needs a reader starts
one (``nodeserver``: this module is the loader's side), which listens on ``<root>/readers/reader.sock``; every later
loader connects to it. The socket lives in the store's private directory (``nodestore.root``: the user's,
0700), each side proves it holds the user's key (``nodestore.values.user_key``, the challenge of
``multiprocessing.connection``, both ways) and the server checks its peer's uid (``SO_PEERCRED``) before
anything is unpickled. A loader then speaks to it as to its own reader process (``isolated``): its source
first, then reads, answered in the same frames. Loaders that send the same source (the same pickled bytes:
one dataset, one selection, one set of keys) share one opened handle, and so Deep Lake's pages.

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
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from pathlib import Path

from ..runtime.loop import start_thread

log = logging.getLogger("asyncload")

SOCKET = "reader.sock"
LOCK = "reader.lock"
#: Seconds a new server may take to listen (an interpreter and asyncload's imports, ~0.2 s; Deep Lake is
#: imported later, while the first loader checks its bucket).
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


def connect(root: Path, module: str = "deeplake") -> tuple[Connection, NodeReader]:
    """A connection to the node's reader under ``root``, started here if none listens (one start per node:
    the connect and the start are one step under ``reader.lock``). ``module``: what a server started here
    imports at once, while this loader checks its bucket and opens its dataset (the source's ``reader_module``)."""
    key = _key()
    try:
        dfd = readers_dir(root)
    except OSError as exc:
        raise NodeUnavailable(f"{root}/readers: {exc}", said=True) from exc
    try:
        lock = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            popen = None
            conn = _dial(dfd, key)
            if conn is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(SOCKET, dir_fd=dfd)  # a server that died without removing it
                popen = _start(root / "readers", module)
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
    """A connection to the server that listens, or None where none does (no socket, refused, or one that
    hung up during the challenge: it was stopping as this loader came)."""
    try:
        return Client(_address(dfd), family="AF_UNIX", authkey=key)
    except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, EOFError):
        return None
    except (OSError, AuthenticationError) as exc:  # a failed challenge: not this user's key
        raise NodeUnavailable(f"the node's reader did not accept this loader: {type(exc).__name__}: {exc}") from exc


def _start(where: Path, module: str) -> subprocess.Popen[bytes]:
    """Start the server and wait until it listens (its first line on stdout). Its environment is this
    process's, with one BLAS thread (``runtime.procs``: numpy's threads would spin in a process that does
    no linear algebra); it stays in this job's process group, so that what ends the job ends it."""
    env = dict(os.environ, **{v: os.environ.get(v, "1") for v in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")})
    code = "from asyncload.processes.nodeserver import main; main()"
    popen = subprocess.Popen([sys.executable, "-c", code, str(where), module], stdin=subprocess.DEVNULL,
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
