"""Hedged reads: a straggler gets a second request, the first answer wins, nothing is lost or doubled,
and the losing read still runs to its end before the epoch's loop closes.

Loaders here read with ``processes=0``: the tests watch the engine in this process (its loop thread, the
source's own counters), which is what a Deep Lake reader process runs too."""

from __future__ import annotations

import asyncio

import pytest

from asyncload import AsyncLoader
from asyncload.engine.hedging import Hedger
from asyncload.engine.stats import Stats

from .conftest import ROWS, wait_no_loop_threads
from .sources import StragglerSource

pytestmark = pytest.mark.timeout(60)


def test_a_straggler_is_hedged_and_the_hedge_wins(seg_url) -> None:
    src = StragglerSource(seg_url, every=50, stall=2.0)
    loader = AsyncLoader(src, batch_size=8, concurrency=16, read_mode="row", hedge=3.0, processes=0)
    got = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        epoch_ids = [i for b in loader for i in b["index"].tolist()]
        assert epoch_ids == list(range(ROWS))  # in order, exactly once, despite racing duplicates
        got += epoch_ids
        s = loader.stats()
        assert src.in_flight == 0  # losers finished before the loop closed
    assert src.stalled >= 3
    assert s["hedges"] >= 1 and s["hedges_won"] >= 1
    wait_no_loop_threads()


def test_no_hedging_when_disabled(seg_url) -> None:
    src = StragglerSource(seg_url, every=50, stall=0.5)
    loader = AsyncLoader(src, batch_size=8, concurrency=16, read_mode="row", hedge=None, processes=0)
    assert [i for b in loader for i in b["index"].tolist()] == list(range(ROWS))
    assert loader.stats()["hedges"] == 0 and src.stalled >= 1


def test_a_straggler_with_nothing_behind_it_is_hedged_on_time(seg_url) -> None:
    """One read in flight: no later read can overtake a stalled one, so its lateness alone must hedge it
    (as for the last read of an epoch)."""
    src = StragglerSource(seg_url, every=50, stall=2.0)
    loader = AsyncLoader(src, batch_size=8, concurrency=1, read_mode="row", hedge=3.0, processes=0)
    assert [i for b in loader for i in b["index"].tolist()] == list(range(ROWS))
    s = loader.stats()
    assert src.stalled >= 1 and s["hedges"] >= 1 and s["hedges_won"] >= 1
    assert src.in_flight == 0


def test_reads_issued_in_one_loop_turn_are_not_counted_as_overtaking_each_other() -> None:
    """Four reads issued together, then a fifth: the fourth is slower than the three issued with it, but no
    read issued *after* it has finished, so it is queued behind its peers, not a straggler. (Counted when
    their tasks first ran, the three looked issued after it, and it was hedged.)"""
    seconds = {0: 0.3, 1: 0.3, 2: 0.3, 3: 1.0, 4: 2.0}
    calls = {i: 0 for i in seconds}

    async def read(idx: list[int], raw: frozenset[str]) -> list[int]:
        calls[idx[0]] += 1
        await asyncio.sleep(seconds[idx[0]])
        return idx

    async def main() -> None:
        stats = Stats()
        stats.latencies.extend([0.05] * 64)  # hedge after 3 x 0.05 s
        hedger = Hedger(read, stats, 3.0, 0.05)
        first = [asyncio.ensure_future(hedger.read([i])) for i in range(4)]  # one loop turn
        await asyncio.sleep(0.02)
        results = await asyncio.gather(*first, hedger.read([4]))
        assert [r for r, _ in results] == [[i] for i in range(5)]
        await hedger.drain()

    asyncio.run(main())
    assert calls == {0: 1, 1: 1, 2: 1, 3: 1, 4: 2}  # read 4 has nothing behind it: hedged on time
