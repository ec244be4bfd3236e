"""Waiting for a foreign future (Deep Lake's) by polling it, never through its ``__await__``.

Why: Deep Lake 4.7.4's ``Future.__await__`` races with its own completion. When the read has already
finished, ``__await__`` hands the completion to one of Deep Lake's threads and goes on using state that
the completion frees as soon as the awaiting thread releases the GIL; a garbage collection that runs a
finaliser inside ``__await__`` releases it, and the process segfaults (13-16 of 20 stress runs, 40 of 40
with a finaliser that sleeps: ``benchmarks/results/isolation/deeplake_await_crash.md``). ``is_completed()``
and ``result()`` touch no asyncio object and did not crash under the same stress, so that is how a
completion is observed here.

How: one poller per event loop, not one timer per future. It runs only while futures are pending, scans
them all in one callback, settles each finished one into a plain asyncio future, and polls again after
``MIN_DELAY`` while reads are completing, backing off to ``MAX_DELAY`` while none do; after each completion
it first looks again on the loop's next turns (``SPINS``), since a local read is quicker than a timer. A
poll costs one ``is_completed()`` call per pending future; the delay it adds to a read is at most one
period (epoll's timer resolution makes the shortest period ~1 ms).
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Protocol


class Pollable(Protocol):
    """What a polled future offers: Deep Lake's ``Future`` has exactly this."""

    def is_completed(self) -> bool: ...

    def result(self) -> Any: ...


#: The first period after a poll that settled something (seconds): reads that finish together are
#: handed on together, and a burst of completions is seen within ~1 ms (epoll's timer resolution).
MIN_DELAY = 0.0002
#: The longest period while nothing completes: a read that finishes is seen within 2 ms, an idle pending
#: set costs at most 500 wake-ups a second.
MAX_DELAY = 0.002
#: After a poll that settled something (or a first read), the poller looks again on the loop's next turns,
#: without a timer, this many times before it falls back to ``MIN_DELAY``: a local read takes well under
#: the 1 ms a timer costs, and while reads keep completing each turn hands them on at once. A look costs
#: ~0.2 us per pending read (``is_completed()``), 13 us for 64.
SPINS = 4


class _Poller:
    """The futures one loop waits on, polled together."""

    def __init__(self) -> None:
        # No reference to the loop: the loop is this poller's key in a weak dictionary.
        self.pending: list[tuple[Pollable, asyncio.Future[Any]]] = []
        self.delay = MIN_DELAY
        self.spins = 0
        self.scheduled: asyncio.Handle | None = None

    def add(self, loop: asyncio.AbstractEventLoop, fut: Pollable) -> asyncio.Future[Any]:
        waiter = loop.create_future()
        self.pending.append((fut, waiter))
        if self.scheduled is None:
            self.delay, self.spins = MIN_DELAY, 0
            self.scheduled = loop.call_soon(self.poll)
        return waiter

    def poll(self) -> None:
        self.scheduled = None
        still: list[tuple[Pollable, asyncio.Future[Any]]] = []
        settled = False
        for fut, waiter in self.pending:
            if waiter.done():  # its awaiting task was cancelled: the read is abandoned, never cancelled
                continue
            if not fut.is_completed():
                still.append((fut, waiter))
                continue
            settled = True
            try:
                value = fut.result()  # does not block: the read has completed
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, as ``await`` would
                waiter.set_exception(exc)
            else:
                waiter.set_result(value)
        self.pending = still
        loop = asyncio.get_running_loop()
        if not still:
            _pollers.pop(loop, None)
            return
        if settled:
            self.delay, self.spins = MIN_DELAY, 0
        if self.spins < SPINS:
            self.spins += 1
            self.scheduled = loop.call_soon(self.poll)
            return
        self.scheduled = loop.call_later(self.delay, self.poll)
        self.delay = min(self.delay * 2, MAX_DELAY)


#: Weak: a loop closed with reads pending (its poll never runs again) is not kept alive by its poller.
_pollers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Poller] = weakref.WeakKeyDictionary()


async def completion(fut: Pollable) -> Any:
    """``fut``'s result (or its exception, with the type ``result()`` gives it), observed by polling.

    Use this wherever a Deep Lake future would be awaited. A task cancelled while waiting leaves the read
    to finish on its own (a Deep Lake future is never cancelled: it would hang)."""
    if fut.is_completed():
        return fut.result()
    loop = asyncio.get_running_loop()
    poller = _pollers.get(loop)
    if poller is None:
        poller = _pollers[loop] = _Poller()
    return await poller.add(loop, fut)


async def completions(*futs: Pollable) -> list[Any]:
    """Every result of ``futs``, in order: ``asyncio.gather`` for Deep Lake futures (gathering them directly
    would call their ``__await__``)."""
    return list(await asyncio.gather(*(completion(f) for f in futs)))
