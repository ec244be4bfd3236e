"""Hedged reads: a read far slower than recent ones gets a second request, and the first answer wins.

Why: on object stores a few requests in a thousand stall for seconds (a slow disk, a lost packet waiting
for its retransmission timer), and with batches delivered in order one stalled read holds up everything
behind it. Racing a second request for it after ``hedge`` × the recent p99 latency costs a few percent
more requests and removes the tail.

A read is a straggler only once reads issued after it have finished first (or, when none was issued
after it, as at the tail of an epoch or with one read in flight, once it took that long). A read that is merely
queued (every read slower because the client or the store is busy) is not one, and a second request
would only add to the queue, and on a busy client most such second requests lose the race
(``benchmarks/results/wan/limits.md``).

The loser is never cancelled (a cancelled Deep Lake future hangs forever): it runs to its end in the
background, its result dropped, and ``drain()`` waits for it before the epoch's loop may close.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .stats import Stats

#: A read as the hedger makes it: ``read(indices, raw)``, ``raw`` as in ``Source.read``.
Read = Callable[[list[int], frozenset[str]], Awaitable[Any]]


class Hedger:
    """Reads through ``read(indices, raw)``, hedging stragglers; counts hedges in ``stats``."""

    def __init__(
        self, read: Read, stats: Stats, factor: float | None, floor_s: float, again: Read | None = None
    ) -> None:
        self._read = read
        self._again = again or read  # a hedge's read: its rows alone (not a join of the straggling block read)
        self._stats = stats
        self._factor = factor
        self._floor_s = floor_s
        self._after_s: float | None = None
        self._at = 0  # requests counted when ``_after_s`` was last computed
        self._stragglers: set[asyncio.Future[Any]] = set()  # hedged-away reads still running
        self._started = 0  # reads started through this hedger (hedges included)
        self._finished = 0  # ... and finished, whatever their outcome

    def after(self) -> float | None:
        """Seconds after which a read is a straggler worth a second request: ``factor`` × the recent p99
        of read latency, once there are enough reads to know it (recomputed every 64 reads)."""
        st = self._stats
        if not self._factor or len(st.latencies) < 64:
            return None
        if st.requests - self._at >= 64 or self._after_s is None:
            lat = sorted(st.latencies)
            self._after_s = max(self._floor_s, self._factor * lat[int(0.99 * (len(lat) - 1))])
            self._at = st.requests
        return self._after_s

    def _start(self, idx: list[int], raw: frozenset[str], hedge: bool = False) -> asyncio.Future[tuple[Any, float]]:
        """Issue a read now. Counted here, not when its task first runs: reads issued in the same loop
        turn must count as issued before or after one another in the order they were issued."""
        self._started += 1
        return asyncio.ensure_future(self._timed(idx, raw, hedge))

    async def _timed(self, idx: list[int], raw: frozenset[str], hedge: bool = False) -> tuple[Any, float]:
        t0 = time.perf_counter()
        try:
            part = await (self._again if hedge else self._read)(idx, raw)
        finally:
            self._finished += 1
        return part, time.perf_counter() - t0

    async def read(self, idx: list[int], raw: frozenset[str] = frozenset()) -> tuple[Any, float]:
        """``(result, seconds)`` of reading ``idx``, racing a second request if the first straggles; both
        are passed ``raw``."""
        after = self.after()
        if after is None:  # no latencies to judge by yet (or hedging off): no task to race
            self._started += 1
            return await self._timed(idx, raw)
        ahead, finished = self._started - self._finished, self._finished  # reads in flight before this one
        first = self._start(idx, raw)
        issued = self._started  # reads issued up to and including this one
        wait = after
        while True:
            done, _ = await asyncio.wait({first}, timeout=wait)
            if done:
                return first.result()
            if self._started <= issued:
                break  # no read was issued after it (one in flight, an epoch's tail): time is all there is
            # finished since it started, less those that were ahead of it: at least that many reads issued
            # after it have overtaken it
            if self._finished - finished - ahead >= max(2, ahead // 2):
                break
            wait = max(self._floor_s, after / 4)
        self._stats.hedges += 1
        second = self._start(idx, raw, hedge=True)
        pending = {first, second}
        error: BaseException | None = None
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task.exception() is None:
                    for loser in pending:  # left to finish on their own
                        self._stragglers.add(loser)
                        loser.add_done_callback(_forget(self._stragglers))
                    if task is second:
                        self._stats.hedges_won += 1
                    return task.result()
                error = error or task.exception()
        assert error is not None
        raise error

    def cancel(self) -> None:
        """Cancel the reads lost to a hedge (only for a source whose reads may be cancelled)."""
        for t in self._stragglers:
            t.cancel()

    async def drain(self) -> None:
        """Wait for reads lost to a hedge: they must end before the loop may close."""
        while busy := [t for t in self._stragglers if not t.done()]:  # done ones: see Pipeline.run
            await asyncio.gather(*busy, return_exceptions=True)


def _forget(group: set[asyncio.Future[Any]]) -> Any:
    """A done-callback that drops a finished background read and consumes its error, if any."""

    def done(fut: asyncio.Future[Any]) -> None:
        group.discard(fut)
        if not fut.cancelled():
            fut.exception()

    return done


__all__ = ["Hedger"]
