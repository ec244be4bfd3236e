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

Paced by how long reads take: the poller keeps a running mean of how long the futures it settled had
waited (``lag``). Looking sooner than ``lag / LAG_SHARE`` after a completion, or spinning on the loop's
turns, finds nothing when reads take tens or hundreds of milliseconds (a store across a WAN, ~0.7 s for a
column read of 32 PNG rows at 50 ms): there the period starts at that share of a read's time and backs off
to at most ``MAX_SLOW_DELAY``, so the delay it adds stays within ``1 / LAG_SHARE`` of a read's time, while
the wake-ups of a waiting loop (each a context switch and a scan) fall by up to 8x.
Local reads (a lag under ``SPIN_LAG``) are polled as before. The figures: benchmarks/results/cpu/.
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
#: A read's time over the first period after a completion: the delay the poller adds to a read stays within
#: 1/32 (3%) of how long reads take, never above ``MAX_SLOW_DELAY``.
LAG_SHARE = 32
#: The longest period, for reads that take ``LAG_SHARE * MAX_SLOW_DELAY`` (512 ms) or more.
MAX_SLOW_DELAY = 0.016
#: Reads that take less than this (local disk, memory) are looked for on the loop's next turns (``SPINS``).
SPIN_LAG = 0.002
#: Weight of each settled future's wait in the running mean ``lag``.
LAG_WEIGHT = 0.125


class _Poller:
    """The futures one loop waits on, polled together."""

    def __init__(self) -> None:
        # No reference to the loop: the loop is this poller's key in a weak dictionary.
        self.pending: list[tuple[Pollable, asyncio.Future[Any], float]] = []  # (future, waiter, added at)
        self.delay = MIN_DELAY
        self.spins = 0
        self.lag = 0.0  # running mean of how long settled futures waited here (seconds; 0: none yet)
        self.scheduled: asyncio.Handle | None = None

    def _floor(self) -> float:
        """The first period after a completion: a share of how long reads take, at least ``MIN_DELAY``."""
        return min(max(self.lag / LAG_SHARE, MIN_DELAY), MAX_SLOW_DELAY)

    def _restart(self) -> None:
        """Look again soon: after the first period, and on the loop's next turns only for reads that take
        less than ``SPIN_LAG`` (for longer ones none would be found there: their spins count as spent)."""
        self.delay, self.spins = self._floor(), 0 if self.lag < SPIN_LAG else SPINS

    def _ceiling(self) -> float:
        """The longest period: ``MAX_DELAY``, or more for reads that take long enough to afford it."""
        return min(max(self.lag / LAG_SHARE, MAX_DELAY), MAX_SLOW_DELAY)

    def add(self, loop: asyncio.AbstractEventLoop, fut: Pollable) -> asyncio.Future[Any]:
        waiter = loop.create_future()
        self.pending.append((fut, waiter, loop.time()))
        if self.scheduled is None:
            self._restart()
            self.scheduled = loop.call_soon(self.poll)
        return waiter

    def poll(self) -> None:
        self.scheduled = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        still: list[tuple[Pollable, asyncio.Future[Any], float]] = []
        settled = False
        for entry in self.pending:
            fut, waiter, added = entry
            if waiter.done():  # its awaiting task was cancelled: the read is abandoned, never cancelled
                continue
            if not fut.is_completed():
                still.append(entry)
                continue
            settled = True
            waited = now - added
            self.lag = waited if not self.lag else self.lag + LAG_WEIGHT * (waited - self.lag)
            try:
                value = fut.result()  # does not block: the read has completed
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, as ``await`` would
                waiter.set_exception(exc)
            else:
                waiter.set_result(value)
        self.pending = still
        if not still:
            return  # idle: kept (with its ``lag``) for the loop's next reads, scheduled again by ``add``
        if settled:
            self._restart()
        if self.spins < SPINS:
            self.spins += 1
            self.scheduled = loop.call_soon(self.poll)
            return
        self.scheduled = loop.call_later(self.delay, self.poll)
        self.delay = min(self.delay * 2, self._ceiling())


#: Weak: a loop closed with reads pending (its poll never runs again) is not kept alive by its poller. A
#: poller with nothing pending stays, idle (no callback scheduled), keeping what it learnt of reads' time.
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
