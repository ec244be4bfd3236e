"""Per-event-loop resources (an HTTP session, a decode pool) that close when their loop ends.

Why: an ``aiohttp.ClientSession`` belongs to the loop it was created on and must be closed on it, but a
source is opened from whatever thread first asks (often the consumer thread) and read on the loader's
loop thread, which lives for one epoch. So resources are created lazily *on the loop that reads*, one
set per loop, and a keeper task owns their lifetime: when the loop shuts down, asyncload's loop thread
(and ``asyncio.run``) cancels every pending task and runs them to the end, and the keeper's ``finally``
closes the session there, on its own loop, before the loop is closed. No "Unclosed client session".

Nothing here crosses a fork: a child process starts with an empty table and never touches (or closes)
the parent's objects.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


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
