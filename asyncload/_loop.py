"""The background thread that owns an asyncio event loop: all thread/loop plumbing lives here.

Why a module of its own: every subtle rule about threads and loops is in one place, so the loader can be
written as if it were plain asyncio code.

- The loop is created inside the thread that runs it, lazily, in the process that iterates. A
  ``LoopThread`` carried into a child by ``fork`` is seen as *not started* there (the pid differs), so a
  forked DataLoader worker starts its own loop instead of talking to a thread that does not exist.
- Blocking calls that would wait on the loop (``submit(...).result()``) are refused from the loop's own
  thread: that is a self-deadlock, not a slow call.
- CPU work (collation, transforms, decoding) goes to a small thread pool owned by the same object, so the
  loop thread only moves requests.
- Interpreter exit stops every live loop through ``threading._register_atexit``: those hooks run before
  Python joins non-daemon threads and before ``atexit``, which is the window where in-flight reads can
  still complete into a running loop. A loop must never be closed while a store's C++ thread may still
  complete a future into it (Deep Lake aborts the process with "Event loop is closed"), so the exit hook
  asks the loop's *owner* (``owner_close``) to stop its work and wait for reads in flight first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, Literal, TypeVar

log = logging.getLogger("asyncload")

T = TypeVar("T")
LoopKind = Literal["auto", "uvloop", "asyncio"]

_live: weakref.WeakSet[LoopThread] = weakref.WeakSet()
_exit_hook_pid: int | None = None
_exit_hook_lock = threading.Lock()


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


def _stop_all_at_exit() -> None:
    for lt in list(_live):
        owner_close = lt.owner_close() if lt.owner_close is not None else None
        if owner_close is not None:
            owner_close()  # the owner stops its work first, then the loop
        else:
            lt.stop()


def _register_exit_hook() -> None:
    """Register the interpreter-exit hook once per process (a forked child registers its own)."""
    global _exit_hook_pid
    with _exit_hook_lock:
        if _exit_hook_pid == os.getpid():
            return
        _exit_hook_pid = os.getpid()
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            try:
                register(_stop_all_at_exit)
                return
            except RuntimeError:  # already shutting down
                return
        import atexit

        atexit.register(_stop_all_at_exit)


class LoopThread:
    """One event loop on one daemon thread, plus a CPU thread pool, started lazily and stopped once.

    ``cpu_workers`` sizes the pool for work that must not run on the loop thread.
    """

    def __init__(
        self,
        name: str = "asyncload-loop",
        *,
        loop: LoopKind = "auto",
        cpu_workers: int = 2,
        owner_close: Callable[[], None] | None = None,
    ) -> None:
        self._name = name
        # Weak, so that the owner (an epoch iterator) can still be garbage-collected while its loop runs.
        self.owner_close: weakref.WeakMethod[Callable[[], None]] | None = (
            weakref.WeakMethod(owner_close) if owner_close is not None else None  # type: ignore[arg-type]
        )
        self._kind: LoopKind = loop
        self._cpu_workers = max(1, cpu_workers)
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """True when this process's loop thread is alive (False in a forked child)."""
        return self._pid == os.getpid() and self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread and its loop if this process has none yet; returns once the loop runs."""
        with self._lock:
            if self.running:
                return
            # Anything inherited through fork belongs to the parent: forget it, never touch it.
            self._loop = self._thread = self._pool = None
            self._pid = os.getpid()
            ready = threading.Event()
            failure: list[BaseException] = []

            def main() -> None:
                try:
                    loop = _new_event_loop(self._kind)
                except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                    failure.append(exc)
                    ready.set()
                    return
                asyncio.set_event_loop(loop)
                self._loop = loop
                loop.call_soon(ready.set)
                try:
                    loop.run_forever()
                finally:
                    self._close_loop(loop)

            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._cpu_workers, thread_name_prefix=f"{self._name}-cpu"
            )
            self._thread = threading.Thread(target=main, name=self._name, daemon=True)
            self._thread.start()
            ready.wait()
            if failure:
                self._thread.join()
                self._pool.shutdown()
                raise failure[0]
            _register_exit_hook()
            _live.add(self)

    @staticmethod
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

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop, join the thread and the pool; True when everything ended within ``timeout``.

        Safe to call many times, from any thread but the loop's own, and in a forked child (no-op).
        """
        with self._lock:
            if self._pid != os.getpid() or self._thread is None:
                return True
            thread, loop, pool = self._thread, self._loop, self._pool
            if threading.current_thread() is thread:
                raise RuntimeError("LoopThread.stop() called from its own loop thread")
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(loop.stop)
                except RuntimeError:  # closed between the check and the call
                    pass
            thread.join(timeout)
            ok = not thread.is_alive()
            if pool is not None:
                pool.shutdown(wait=ok, cancel_futures=True)
            if ok:
                self._thread = self._loop = self._pool = None
                _live.discard(self)
            else:
                log.warning("asyncload: loop thread %s did not stop within %.1fs", self._name, timeout)
            return ok

    # -- calls into the loop ---------------------------------------------------------------------
    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if not self.running or self._loop is None:
            raise RuntimeError("the asyncload loop thread is not running in this process")
        return self._loop

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; the returned future may be waited on from any other thread."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("refusing to submit to the asyncload loop from its own thread (it would deadlock)")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop thread soon; silently dropped once the loop is closed."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._pid != os.getpid():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    async def run_cpu(self, fn: Callable[..., T], *args: Any) -> T:
        """Await ``fn(*args)`` run on the CPU pool, keeping the loop thread free (call from the loop)."""
        assert self._pool is not None
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)


def call_in_thread(fn: Callable[[], T], timeout: float, name: str = "asyncload-blocking") -> asyncio.Future[T | None]:
    """A future of the running loop that ``fn()``'s result (or exception, as the value) settles, from a
    short-lived daemon thread; ``None`` if it takes longer than ``timeout``.

    For a rare blocking call that must not hold the loop or a pool thread hostage (a store that hangs
    keeps only its own daemon thread). Call from a coroutine.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any) -> None:
        if not fut.done():
            fut.set_result(value)

    def run() -> None:
        try:
            value: Any = fn()
        except BaseException as exc:  # noqa: BLE001 - the exception is the answer
            value = exc
        try:
            loop.call_soon_threadsafe(settle, value)
        except RuntimeError:  # loop already closed: nobody waits any more
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    loop.call_later(timeout, settle, None)
    return fut


# -- per-loop resources and blocking helpers for sources ------------------------------------------------
# An ``aiohttp.ClientSession`` belongs to the loop it was created on and must be closed on it, but a source
# is opened from whatever thread first asks and read on a loader's loop thread, which lives for one epoch.
# ``LoopLocal`` makes such a resource lazily *on the loop that reads*, one per loop, and a keeper task owns
# its lifetime: when the loop shuts down its pending tasks are cancelled and run to the end, and the
# keeper's ``finally`` closes the resource there, on its own loop, before the loop is closed. Nothing here
# crosses a fork: a child starts with an empty table and never touches the parent's objects.


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

    t = threading.Thread(target=main, name="asyncload-blocking", daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise TimeoutError(f"{what} did not finish within {timeout or 0:.1f}s")
    ok, value = box[0]
    if ok:
        return value
    raise value
