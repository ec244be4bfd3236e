"""The processes asyncload starts (fan-out workers, isolated readers): how they start, run, end and are reaped.

Both kinds start by reference (spawn or forkserver) and run ``run_child``: the parent's environment, deaf
to Ctrl-C (it reaches the whole process group; the parent decides when its children stop), and
``os._exit`` once their body has closed what it opened, skipping an interpreter teardown that costs
~0.5 s and, with Deep Lake 4.7.4, sometimes aborts.

This module imports neither torch nor anything that does: an isolated reader imports only it, the source
and Deep Lake, so that it starts in a fraction of the time and memory a torch import costs.

A child that does no linear algebra (an isolated reader) starts with ``quiet_blas``: its target and
arguments travel pickled, and are unpickled (importing numpy) only once ``OPENBLAS_NUM_THREADS`` and
``MKL_NUM_THREADS`` are 1 in its environment. Otherwise numpy's import starts one OpenBLAS thread per
core, which spin while they wait: a large part of a reader's start, in CPU taken from the training
process on a small machine (benchmarks/results/first_epoch).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.resource_sharer
import multiprocessing.spawn
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

log = logging.getLogger("asyncload")


def signal_name(exitcode: int) -> str:
    """``SIGSEGV`` for a process killed by signal 11 (exit code -11); the number where it has no name."""
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return str(-exitcode)


def cause_of_death(exitcode: int | None) -> str:
    """What ended a child, for naming a row that kills it: ``SIGSEGV``, ``signal 99`` where the signal has
    no name, or ``exit code 1`` for a child that exited."""
    if exitcode is not None and exitcode < 0:
        name = signal_name(exitcode)
        return name if name.startswith("SIG") else f"signal {name}"
    return f"exit code {exitcode}"


def how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        return f"was killed by signal {signal_name(exitcode)}"
    return f"exited with code {exitcode}" + (" (its traceback is on stderr)" if exitcode else "")


def stop_processes(procs: list[BaseProcess], timeout: float) -> None:
    """Join ``procs`` (already asked to stop); SIGTERM the ones still alive after ``timeout``, SIGKILL
    the ones still alive ``timeout`` later; release every process object."""
    for step in ("join", "terminate", "kill"):
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        if step != "join":
            log.warning(
                "asyncload: child processes %s did not stop within %.1fs: %s", [p.pid for p in alive], timeout, step
            )
            for p in alive:
                getattr(p, step)()
        deadline = time.monotonic() + timeout
        for p in alive:
            p.join(None if step == "kill" else max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode != 0 and p.pid is not None:
            _unlink_orphaned_shm(p.pid)
        _release(p)


def kill_processes(procs: list[BaseProcess], grace: float) -> None:
    """End ``procs`` (already asked to stop) now: join them for up to ``grace`` seconds, SIGKILL the ones
    still alive, join those, and release every process object (and any shared memory one left).

    For the processes asyncload starts to read (fan-out workers, Deep Lake readers): they hold nothing of
    the user's, so a stop never waits on them (a reader stuck in a read of a silent store would otherwise
    hold a Ctrl-C or a ``close()`` for ``shutdown_timeout``). An idle one exits in the grace by itself."""
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
    for p in procs:
        p.join()
        if p.exitcode != 0 and p.pid is not None:
            _unlink_orphaned_shm(p.pid)
        _release(p)


def _release(p: BaseProcess) -> None:
    """Release a joined process object. Where another thread reaped the child first (any call of
    ``multiprocessing.active_children()``, the user's or a test's, waits on every child without blocking),
    this object's own wait found no child and it still says "running": the process is gone all the same."""
    try:
        p.close()
    except ValueError:
        pass


def reap_process(proc: BaseProcess, timeout: float) -> tuple[int | None, int | None]:
    """Join a child that died or broke its pipe (killed if it is still alive a second later), release it
    and any shared memory it left; its ``(pid, exitcode)``."""
    proc.join(1.0)
    if proc.exitcode is None:  # a broken pipe without a death: make it one
        proc.kill()
        proc.join()
    pid, exitcode = proc.pid, proc.exitcode
    stop_processes([proc], timeout)
    return pid, exitcode


def _unlink_orphaned_shm(pid: int) -> None:
    """Remove the shared-memory files a worker that did not exit cleanly left in ``/dev/shm``.

    torch names each file ``torch_<pid>_...`` and unlinks it right after mapping it, but a worker killed
    between the two (SIGKILL while allocating a batch) leaves the file behind, and nothing else would ever
    remove it: it holds RAM until reboot. Called only after the worker was joined, so the files are
    nobody's."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:  # not Linux, or no /dev/shm: torch made no such files
        return
    for name in names:
        if name.startswith(f"torch_{pid}_"):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except OSError:
                pass
            log.warning("asyncload: removed /dev/shm/%s, left by child process pid %d", name, pid)


_prep_lock = threading.Lock()


@contextlib.contextmanager
def _main_module_left_out(leave_out: bool) -> Iterator[None]:
    """While a worker starts: with ``leave_out``, the preparation data that spawn and forkserver send a
    new process omits the main module, so the worker does not import (run) the user's script. There is
    no switch for it in ``multiprocessing``; its ``Popen`` classes call ``spawn.get_preparation_data``
    by module attribute, which is wrapped here for the duration of one ``start()``."""
    if not leave_out:
        yield
        return
    original = multiprocessing.spawn.get_preparation_data

    def without_main(name: str) -> dict[str, Any]:
        data = original(name)
        data.pop("init_main_from_path", None)
        data.pop("init_main_from_name", None)
        return data

    with _prep_lock:
        multiprocessing.spawn.get_preparation_data = without_main  # type: ignore[assignment]
        try:
            yield
        finally:
            multiprocessing.spawn.get_preparation_data = original  # type: ignore[assignment]


#: Thread-count settings of the BLAS libraries numpy may load; read once, when the library loads.
_BLAS_THREADS = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _quiet_blas_main(conn: Connection, payload: bytes, environ: dict[str, str]) -> None:
    """A ``quiet_blas`` child's entry: one BLAS thread unless the parent's environment says how many, set
    before the target and its arguments are unpickled (which imports numpy); then the target."""
    for var in _BLAS_THREADS:
        os.environ[var] = environ.get(var, "1")
    target, args = pickle.loads(payload)
    target(conn, *args, environ)


def start_child(
    context: str, target: Any, args: tuple[Any, ...], *, name: str, needs_main: bool, quiet_blas: bool = False
) -> tuple[BaseProcess, Connection]:
    """Start ``target(conn, *args, environ)`` in a new daemonic process of ``context`` ("forkserver" or
    "spawn"); the parent's end of their duplex pipe comes back with the process. ``needs_main``: the
    pickled ``args`` name the user's ``__main__`` (a transform defined in the script), which the child
    must then import; otherwise it does not (``_main_module_left_out``). ``quiet_blas``: numpy in the
    child gets one BLAS thread (see the module doc); ``args`` are then pickled here, by the pickler
    ``multiprocessing`` uses (the one the loader tries a source with), so they must not hold what only
    pickles while a process starts (connections, file descriptors)."""
    ctx: Any = multiprocessing.get_context(context)  # SpawnContext or ForkServerContext
    if context == "forkserver":
        # The server imports torch once, the bulk of a fan-out worker's start; then each worker (a new
        # one, or one replacing a dead one) is a fork of it that imports the rest. Not Deep Lake, whose import
        # starts its native threads, nor ``__main__`` (the default), which imports it: a fork must not
        # inherit that runtime. No effect once the server runs.
        ctx.set_forkserver_preload(["torch"])
    # Children inherit this process's multiprocessing temp dir (where the sockets that pass file
    # descriptors live) instead of making their own, which ``os._exit`` would leave behind.
    multiprocessing.util.get_temp_dir()
    parent_end, child_end = ctx.Pipe(duplex=True)
    # The parent's environment as of now: a forkserver's children would otherwise inherit the server's,
    # as of when it started (credentials set since, such as ``AWS_*``, would never reach them).
    environ = dict(os.environ)
    if quiet_blas:
        payload = bytes(ForkingPickler.dumps((target, args)))
        proc = ctx.Process(target=_quiet_blas_main, args=(child_end, payload, environ), name=name, daemon=True)
    else:
        proc = ctx.Process(target=target, args=(child_end, *args, environ), name=name, daemon=True)
    try:
        with _main_module_left_out(not needs_main):
            proc.start()
    except BaseException:
        parent_end.close()
        raise
    finally:
        child_end.close()  # the child holds its end now; ours would hide its EOF
    return proc, parent_end


def run_child(environ: dict[str, str], body: Any, *args: Any) -> None:
    """How every process asyncload starts runs ``body(*args)`` and leaves: with the parent's environment,
    deaf to Ctrl-C (it reaches the whole process group; the parent decides when its children stop), its
    traceback on stderr if it fails, and ``os._exit`` once ``body`` has closed what it opened."""
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        body(*args)
    except BaseException:  # noqa: BLE001 - last resort: say it where a person will look
        traceback.print_exc()
        code = 1
    finally:
        try:
            multiprocessing.resource_sharer.stop(timeout=1.0)  # removes its socket file
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        # What ``body`` opened is closed (reads in flight awaited): skip interpreter teardown (see the module doc).
        os._exit(code)
