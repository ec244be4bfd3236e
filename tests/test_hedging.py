"""Hedged reads: a straggler gets a second request, the first answer wins, nothing is lost or doubled,
and the losing read still runs to its end before the epoch's loop closes."""

from __future__ import annotations

import pytest

from asyncload import AsyncLoader

from .conftest import ROWS, wait_no_loop_threads
from .sources import StragglerSource

pytestmark = pytest.mark.timeout(60)


def test_a_straggler_is_hedged_and_the_hedge_wins(seg_url) -> None:
    src = StragglerSource(seg_url, every=50, stall=2.0)
    loader = AsyncLoader(src, batch_size=8, concurrency=16, read_mode="row", hedge=3.0)
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
    loader = AsyncLoader(src, batch_size=8, concurrency=16, read_mode="row", hedge=None)
    assert [i for b in loader for i in b["index"].tolist()] == list(range(ROWS))
    assert loader.stats()["hedges"] == 0 and src.stalled >= 1


def test_a_straggler_with_nothing_behind_it_is_hedged_on_time(seg_url) -> None:
    """One read in flight: no later read can overtake a stalled one, so its lateness alone must hedge it
    (as for the last read of an epoch)."""
    src = StragglerSource(seg_url, every=50, stall=2.0)
    loader = AsyncLoader(src, batch_size=8, concurrency=1, read_mode="row", hedge=3.0)
    assert [i for b in loader for i in b["index"].tolist()] == list(range(ROWS))
    s = loader.stats()
    assert src.stalled >= 1 and s["hedges"] >= 1 and s["hedges_won"] >= 1
    assert src.in_flight == 0
