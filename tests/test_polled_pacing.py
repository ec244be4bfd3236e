"""The poller of Deep Lake futures (``runtime.polled``) paces itself by how long reads take.

Reads that take hundreds of milliseconds (a store across a WAN) are looked for a few dozen times a second,
not 500: each look is a wake-up of the loop that finds nothing. Reads that take well under a millisecond
(local disk) are still looked for on the loop's next turns. Every result arrives, once, in any order, with
its exception's type. Fake futures stand in for Deep Lake's: the pacing is the poller's, whatever polls.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from asyncload.runtime import polled
from asyncload.runtime.polled import MAX_SLOW_DELAY, completion, completions

from .timing import within


class _Fake:
    """A future that completes ``after`` seconds from now (``is_completed``/``result``: Deep Lake's shape)."""

    def __init__(self, after: float, value: object, error: BaseException | None = None) -> None:
        self.done_at = time.monotonic() + after
        self.value, self.error = value, error

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def result(self) -> object:
        assert self.is_completed(), "result() of a read still in flight would block"
        if self.error is not None:
            raise self.error
        return self.value


@pytest.fixture
def polls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many times the poller looked (one count per ``poll``)."""
    count = [0]
    real = polled._Poller.poll

    def counted(self: polled._Poller) -> None:
        count[0] += 1
        real(self)

    monkeypatch.setattr(polled._Poller, "poll", counted)
    return count


async def _waves(after: float, waves: int, width: int) -> tuple[list[object], float]:
    """``waves`` rounds of ``width`` reads of ``after`` seconds each, staggered within a round: (results,
    the longest a read waited past its completion)."""
    late = 0.0
    got: list[object] = []
    for w in range(waves):
        futs = [_Fake(after * (1 + k / width), (w, k)) for k in range(width)]

        async def one(f: _Fake) -> object:
            v = await completion(f)
            nonlocal late
            late = max(late, time.monotonic() - f.done_at)
            return v

        got += await asyncio.gather(*(one(f) for f in futs))
    return got, late


async def test_slow_reads_are_looked_for_a_few_dozen_times_a_second(polls: list[int]) -> None:
    await _waves(0.25, waves=1, width=4)  # the poller learns how long reads take
    polls[0] = 0
    began = time.monotonic()
    got, late = await _waves(0.25, waves=4, width=4)
    spent = time.monotonic() - began
    assert got == [(w, k) for w in range(4) for k in range(4)]
    # ~500 looks a second before (0.2 ms after each completion, backing off to 2 ms); paced by a read's
    # time, one every ~8-16 ms here (MAX_SLOW_DELAY).
    assert polls[0] / spent < 100, f"{polls[0]} looks in {spent:.2f} s"
    # and no read waits past its completion for longer than the slowest period (and the machine's load)
    assert late < within(MAX_SLOW_DELAY + 0.05), late


async def test_fast_reads_are_still_looked_for_at_once(polls: list[int]) -> None:
    # reads of 0.3 ms: the poller keeps looking on the loop's next turns, and hands each on within ~1 ms
    got, late = await _waves(0.0003, waves=20, width=8)
    assert len(got) == 160
    assert late < within(0.02), late
    assert all(not p.pending and p.scheduled is None for p in polled._pollers.values())  # idle, no timer left


async def test_a_slow_store_then_a_fast_one_is_paced_anew() -> None:
    # the pace follows the reads: after slow ones, fast ones are not made to wait for a slow period for long
    await _waves(0.3, waves=2, width=2)
    began = time.monotonic()
    got, _ = await _waves(0.001, waves=30, width=4)
    assert len(got) == 120
    # 30 waves of 1-2 ms reads: ~60 ms when each is seen at once; the running mean forgets 0.3 s reads
    # within a few dozen completions, and no period is longer than MAX_SLOW_DELAY meanwhile.
    assert time.monotonic() - began < within(30 * MAX_SLOW_DELAY + 0.5)


async def test_every_result_and_error_arrives_with_its_type() -> None:
    futs = [_Fake(0.05 * (k % 3), k) for k in range(9)]
    futs[4] = _Fake(0.02, None, IndexError("row 4 out of range"))
    with pytest.raises(IndexError):
        await completions(*futs)
    ok = [_Fake(0.01 * k, k) for k in range(6)]
    assert await completions(*ok) == list(range(6))
