"""Every thread, event loop and exit hook asyncload makes is made here.

Why one module: every subtle rule about threads, loops and process exit lives in one place, so the rest
of the library is written as plain asyncio and plain iterators.

- The loop is created inside the thread that runs it, lazily, in the process that iterates. A
  ``LoopThread`` carried into a child by ``fork`` is seen as *not started* there (the pid differs), so a
  forked DataLoader worker starts its own loop instead of talking to a thread that does not exist.
- Blocking calls that would wait on the loop (``submit(...).result()``) are refused from the loop's own
  thread: that is a self-deadlock, not a slow call.
- CPU work (collation, transforms, decoding) goes to a small thread pool owned by the same object, so the
  loop thread only moves requests.
- Lifetimes: whatever owns a thread, a loop, a worker process or a store handle registers its stop with
  ``on_exit`` at a ``ExitOrder``. The stop runs once: on ``close()``, when the owner is garbage-collected
  (``weakref.finalize``, never ``__del__``), or at interpreter exit, stage by stage: epochs stop their
  work first (reads in flight are awaited: Deep Lake aborts the process when a read completes into a
  closed loop), then bare loop threads, then fan-out worker processes, then store handles. The exit hook
  runs through ``threading._register_atexit``, before Python joins threads and before ``atexit`` (where
  multiprocessing would SIGTERM daemonic workers).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import gc
import inspect
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

log = logging.getLogger("asyncload")

T = TypeVar("T")
LoopKind = Literal["auto", "uvloop", "asyncio"]


def _late_completion(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler. A store's thread that completes a read after its waiter was cancelled
    (loop shutdown cancels what is left: ``_close_loop``) makes ``Future.set_result`` raise
    ``InvalidStateError`` in a callback. Nobody waits for that result, so it is dropped (DEBUG), not printed
    after the traceback of whatever is ending the process. Everything else goes to the default handler."""
    exc = context.get("exception")
    where = repr(context.get("handle"))  # "<Handle Future.set_result>" (uvloop's handles hide their callback)
    if isinstance(exc, asyncio.InvalidStateError) and ("set_result" in where or "set_exception" in where):
        log.debug("asyncload: a read completed after its waiter was cancelled: %s", exc)
        return
    loop.default_exception_handler(context)


def _new_event_loop(kind: LoopKind) -> asyncio.AbstractEventLoop:
    """uvloop when asked for or importable (``auto``); plain asyncio otherwise."""
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def cores_available() -> int:
    """Threads a CPU pool gets when none are asked for: one per core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class ExitOrder(enum.IntEnum):
    """When, at interpreter exit, a registered stop runs: lower stages first."""

    WORK = 0  #: epochs and device feeds: stop issuing reads, await those in flight, stop their loop
    LOOPS = 1  #: loop threads whose owner is gone or never registered
    WORKERS = 2  #: fan-out worker processes
    STORES = 3  #: store handles (a Deep Lake dataset must be released before interpreter teardown)


_exits: dict[ExitOrder, set[weakref.finalize]] = {stage: set() for stage in ExitOrder}
_exits_pid = os.getpid()
_exits_lock = threading.Lock()
_hook_pid: int | None = None


def on_exit(owner: object, stage: ExitOrder, stop: Callable[..., Any], *args: Any) -> weakref.finalize:
    """Register ``stop(*args)`` to run once: when the returned finaliser is called (``close()``), when
    ``owner`` is garbage-collected, or at interpreter exit in ``stage`` order.

    ``stop`` and ``args`` must not refer to ``owner`` (that would keep it alive): pass the state the stop
    needs, or a ``weakref.ref`` to the owner.
    """
    global _exits_pid
    fin = weakref.finalize(owner, stop, *args)
    fin.atexit = False  # the ordered hook below runs it, not weakref's own atexit pass
    with _exits_lock:
        if _exits_pid != os.getpid():  # inherited through fork: the parent's, never ours to run
            for entries in _exits.values():
                entries.clear()
            _exits_pid = os.getpid()
        entries = _exits[stage]
        if len(entries) > 64:
            entries.difference_update([f for f in entries if not f.alive])
        entries.add(fin)
    _register_exit_hook()
    return fin


_exiting = False


def exiting() -> bool:
    """True once the interpreter-exit hook runs: stops then abandon reads that do not answer at once
    (a Ctrl-C must end the process within seconds, not wait ``shutdown_timeout`` for a silent store)."""
    return _exiting


def _run_exits() -> None:
    """The interpreter-exit hook: every registered stop still pending, stage by stage."""
    global _exiting
    if _exits_pid != os.getpid():
        return
    _exiting = True
    for stage in ExitOrder:
        with _exits_lock:
            pending = [f for f in _exits[stage] if f.alive]
            _exits[stage].clear()
        for fin in pending:
            try:
                fin()
            except Exception:  # noqa: BLE001 - best effort at exit; the next stop must still run
                log.exception("asyncload: a stop at interpreter exit (%s) failed", stage.name)
    gc.collect()  # what the stops released (a dataset's C++ objects) goes before interpreter teardown


def _register_exit_hook() -> None:
    """Register the interpreter-exit hook once per process (a forked child registers its own)."""
    global _hook_pid
    with _exits_lock:
        if _hook_pid == os.getpid():
            return
        _hook_pid = os.getpid()
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        try:
            register(_run_exits)
            return
        except RuntimeError:  # already shutting down
            return
    import atexit

    atexit.register(_run_exits)


def _close_unstarted(coro: Coroutine[Any, Any, Any]) -> None:
    """Close ``coro`` if no task has started it (on the loop thread: a task's first step comes after)."""
    if inspect.getcoroutinestate(coro) == inspect.CORO_CREATED:
        coro.close()


def start_thread(target: Callable[..., Any], *args: Any, name: str) -> threading.Thread:
    """Start a daemon thread running ``target(*args)``. The one place asyncload makes a thread: a
    daemon, so that a thread stuck in a store's call can never hold up interpreter exit (its owner's
    stop, registered with ``on_exit``, is what ends it in order)."""
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    thread.start()
    return thread


def thread_pool(workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of ``workers`` threads for CPU work that releases the GIL (decoding, copies)."""
    return concurrent.futures.ThreadPoolExecutor(max(1, workers), thread_name_prefix=name)


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Runs on the loop thread after ``run_forever`` returns: cancel leftovers, then close."""
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


@dataclass
class _Running:
    """A started loop thread's parts, held apart from the ``LoopThread`` so that its finaliser can stop them."""

    name: str
    pid: int
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    pool: concurrent.futures.ThreadPoolExecutor
    stopped: bool = False
    lingering: bool = False  # abandoned reads that cannot be cancelled: the loop stops itself after them

    def stop(self, timeout: float) -> bool:
        """Stop the loop, join the thread and the pool; True when everything ended within ``timeout``.
        A lingering loop (``LoopThread.linger``) is left to stop itself: True at once."""
        if self.stopped or self.pid != os.getpid():  # done, or a forked copy: the thread is not ours
            return True
        if threading.current_thread() is self.thread:
            raise RuntimeError("LoopThread.stop() called from its own loop thread")
        if self.lingering:
            self.stopped = True
            self.pool.shutdown(wait=False, cancel_futures=True)
            return True
        if not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # closed between the check and the call
                pass
        self.thread.join(timeout)
        self.stopped = not self.thread.is_alive()
        self.pool.shutdown(wait=self.stopped, cancel_futures=True)
        if not self.stopped:
            log.warning("asyncload: loop thread %s did not stop within %.1fs", self.name, timeout)
        return self.stopped

    def stop_from_any_thread(self, timeout: float) -> None:
        """The finaliser's stop: a garbage-collection pass may run it on the loop thread itself, which
        cannot join itself, so a helper thread does the stop there."""
        if threading.current_thread() is self.thread:
            start_thread(self.stop, timeout, name="asyncload-stop")
        else:
            self.stop(timeout)


class LoopThread:
    """One event loop on one daemon thread, plus a CPU thread pool, started lazily and stopped once.

    ``cpu_workers`` sizes the pool for work that must not run on the loop thread. The loop stops on
    ``stop()``, when the ``LoopThread`` is garbage-collected, or at interpreter exit (``ExitOrder.LOOPS``:
    after the epochs that own loops have stopped their reads).
    """

    def __init__(self, name: str = "asyncload-loop", *, loop: LoopKind = "auto", cpu_workers: int = 2) -> None:
        self._name = name
        self._kind: LoopKind = loop
        self._cpu_workers = max(1, cpu_workers)
        self._lock = threading.Lock()
        self._run: _Running | None = None
        self._finalizer: weakref.finalize | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def _mine(self) -> _Running | None:
        """This process's running parts (None before ``start``, after ``stop`` and in a forked child)."""
        run = self._run
        return run if run is not None and run.pid == os.getpid() else None

    @property
    def cpu_workers(self) -> int:
        """Threads of the CPU pool."""
        return self._cpu_workers

    @property
    def running(self) -> bool:
        """True when this process's loop thread is alive (False in a forked child)."""
        run = self._mine()
        return run is not None and run.thread.is_alive()

    def start(self) -> None:
        """Start the thread and its loop if this process has none yet; returns once the loop runs."""
        with self._lock:
            if self.running:
                return
            self._run = None  # anything inherited through fork belongs to the parent: never touch it
            ready = threading.Event()
            box: list[Any] = []

            def main() -> None:
                try:
                    loop = _new_event_loop(self._kind)
                    loop.set_exception_handler(_late_completion)
                except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                    box.append(exc)
                    ready.set()
                    return
                asyncio.set_event_loop(loop)
                box.append(loop)
                loop.call_soon(ready.set)
                try:
                    loop.run_forever()
                finally:
                    _close_loop(loop)

            pool = thread_pool(self._cpu_workers, f"{self._name}-cpu")
            thread = start_thread(main, name=self._name)
            ready.wait()
            if isinstance(box[0], BaseException):
                thread.join()
                pool.shutdown()
                raise box[0]
            self._run = _Running(self._name, os.getpid(), thread, box[0], pool)
            self._finalizer = on_exit(self, ExitOrder.LOOPS, self._run.stop_from_any_thread, 10.0)

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop, join the thread and the pool; True when everything ended within ``timeout``.

        Safe to call many times, from any thread but the loop's own, and in a forked child (no-op).
        """
        with self._lock:
            run = self._mine()
            if run is None:
                return True
            ok = run.stop(timeout)
            if ok:
                self._run = None
                if self._finalizer is not None:
                    self._finalizer.detach()
            return ok

    def linger(self, reads: set[asyncio.Future[Any]]) -> None:
        """Leave this loop running until ``reads`` are done, then let it stop and close by itself (call on
        the loop thread). For abandoned reads that cannot be cancelled (a Deep Lake future hangs for ever
        once cancelled, and a read completing into a closed loop aborts the process): a later ``stop()``
        returns at once and the daemon thread ends when the last of them answers, if ever."""
        run = self._mine()
        if run is None:
            return
        pending = {r for r in reads if not r.done()}
        if not pending:
            return
        run.lingering = True
        loop = run.loop

        def one_done(fut: asyncio.Future[Any]) -> None:
            pending.discard(fut)
            if not pending:
                loop.stop()

        for r in pending:
            r.add_done_callback(one_done)

    # -- calls into the loop ---------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        run = self._mine()
        if run is None or not run.thread.is_alive():
            raise RuntimeError("the asyncload loop thread is not running in this process")
        return run.loop

    def in_loop_thread(self) -> bool:
        run = self._run
        return run is not None and threading.current_thread() is run.thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future may be waited on from any other thread."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("refusing to submit to the asyncload loop from its own thread (it would deadlock)")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except BaseException:
            # Not handed over, or handed over and interrupted (a Ctrl-C lands between any two bytecodes)
            # before its future came back: nothing will wait for it. Closed on the loop thread, after the
            # hand-over if there was one, so that a coroutine no task started is not reported "never
            # awaited" at exit, and one a task is running is never touched from this thread.
            if not self.call_soon(_close_unstarted, coro):  # no loop to run it: nothing else holds it
                coro.close()
            raise

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on the loop thread soon; dropped once the loop is closed. Returns whether the
        call was scheduled."""
        run = self._mine()
        if run is None or run.loop.is_closed():
            return False
        try:
            run.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            return False
        return True

    async def run_cpu(self, fn: Callable[..., T], *args: Any) -> T:
        """Await ``fn(*args)`` run on the CPU pool, keeping the loop thread free (call from the loop)."""
        run = self._mine()
        assert run is not None
        return await asyncio.get_running_loop().run_in_executor(run.pool, fn, *args)


class LoopLocal(Generic[T]):
    """A value per running event loop, made by ``make()`` on first use, finalised by ``close(value)``."""

    def __init__(
        self, make: Callable[[], T], close: Callable[[T], Awaitable[None]], name: str = "asyncload-looplocal"
    ) -> None:
        self._make = make
        self._close = close
        self._name = name
        self._pid = os.getpid()
        self._values: dict[asyncio.AbstractEventLoop, tuple[T, asyncio.Task[None]]] = {}

    def get(self) -> T:
        """The value for the running loop (call from a coroutine)."""
        loop = asyncio.get_running_loop()
        if self._pid != os.getpid():  # inherited through fork: forget, never touch
            self._values, self._pid = {}, os.getpid()
        entry = self._values.get(loop)
        if entry is not None and not entry[1].done():
            return entry[0]
        value = self._make()
        keeper = loop.create_task(self._keep(loop, value), name=self._name)
        self._values[loop] = (value, keeper)
        return value

    async def _keep(self, loop: asyncio.AbstractEventLoop, value: T) -> None:
        try:
            await asyncio.Event().wait()  # until cancelled: loop shutdown or close_all()
        finally:
            entry = self._values.get(loop)
            if entry is not None and entry[0] is value:
                del self._values[loop]
            await self._close(value)

    def close_all(self) -> None:
        """Ask every loop still running to finalise its value (does not wait); closed loops are skipped."""
        if self._pid != os.getpid():
            self._values, self._pid = {}, os.getpid()
            return
        for loop, (_, keeper) in list(self._values.items()):
            if loop.is_closed() or keeper.done():
                self._values.pop(loop, None)
                continue
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                keeper.cancel()
            else:
                try:
                    loop.call_soon_threadsafe(keeper.cancel)
                except RuntimeError:  # closed meanwhile
                    pass

    def __len__(self) -> int:
        return len(self._values) if self._pid == os.getpid() else 0


async def _let_go(pool: concurrent.futures.ThreadPoolExecutor) -> None:
    pool.shutdown(wait=False)  # (its thread ends after the call it runs, if any: the loop never waits on it)


#: One thread per running loop for blocking calls that take one lock anyway (the node store's index: every
#: one of its transactions holds ``Index``'s lock), so that they run one after another on one warm thread
#: instead of waking several of the loop's default executor threads that then queue on that lock.
_LANES: LoopLocal[concurrent.futures.ThreadPoolExecutor] = LoopLocal(
    lambda: thread_pool(1, "asyncload-lane"), _let_go, name="asyncload-lane"
)


async def in_lane(fn: Callable[..., T], *args: Any) -> T:
    """Await ``fn(*args)`` on the running loop's lane thread (``_LANES``), calls in the order they came."""
    return await asyncio.get_running_loop().run_in_executor(_LANES.get(), fn, *args)


def run_blocking(make: Callable[[], Coroutine[Any, Any, T]], timeout: float | None, what: str) -> T:
    """Run ``make()`` to the end on a private event loop in a helper thread, from synchronous code.

    For the few blocking steps of a source (probe, listing) that must work from any thread, including
    from inside a running loop, without a second HTTP client. Raises ``TimeoutError`` naming ``what``
    if it has not finished within ``timeout`` seconds (the coroutine's own deadlines end it soon after);
    ``None`` waits for the coroutine, whose every request is bounded by its own deadlines.
    """
    box: list[Any] = []

    def main() -> None:
        try:
            box.append((True, asyncio.run(make())))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box.append((False, exc))

    start_thread(main, name="asyncload-blocking").join(timeout)
    if not box:
        raise TimeoutError(f"{what} did not finish within {timeout or 0:.1f}s")
    ok, value = box[0]
    if ok:
        return value
    raise value
