"""The epoch plan: order, seeds, epochs, shards, remainder policy, batch counts."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from asyncload import EpochSampler, Shard
from asyncload.engine.sampler import block_order


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def test_sequential_order_and_batch_sizes() -> None:
    s = EpochSampler(10, 4)
    assert s.batches(0) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(s) == 3
    d = EpochSampler(10, 4, drop_last=True)
    assert d.batches(0) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(d) == 2


def test_shuffle_is_a_seeded_permutation_per_epoch() -> None:
    s = EpochSampler(100, 7, shuffle=True, seed=3)
    e0, e1 = flat(s.batches(0)), flat(s.batches(1))
    assert sorted(e0) == sorted(e1) == list(range(100))
    assert e0 != list(range(100))
    assert e0 != e1
    assert flat(EpochSampler(100, 7, shuffle=True, seed=3).batches(0)) == e0
    assert flat(EpochSampler(100, 7, shuffle=True, seed=4).batches(0)) != e0


@pytest.mark.parametrize(
    "n,world,workers,bs", [(203, 1, 1, 32), (203, 1, 3, 16), (200, 2, 2, 8), (204, 3, 2, 5), (8, 2, 4, 2)]
)
def test_shards_cover_the_epoch_exactly_once_when_ranks_divide_it(n: int, world: int, workers: int, bs: int) -> None:
    seen: Counter[int] = Counter()
    per_rank = []
    for r in range(world):
        rank_batches = 0
        for w in range(workers):
            s = EpochSampler(n, bs, shuffle=True, seed=1, shard=Shard(r, world, w, workers))
            b = s.batches(5)
            assert len(b) == len(s)
            rank_batches += len(b)
            seen.update(flat(b))
        per_rank.append(rank_batches)
    assert seen == Counter(range(n))
    assert len(set(per_rank)) == 1


def test_workers_take_rank_batches_round_robin() -> None:
    whole = EpochSampler(50, 4, shuffle=True, seed=9).batches(2)
    parts = [EpochSampler(50, 4, shuffle=True, seed=9, shard=Shard(0, 1, w, 3)).batches(2) for w in range(3)]
    interleaved = [b for group in itertools.zip_longest(*parts) for b in group if b is not None]
    assert interleaved == whole


@pytest.mark.parametrize("n,world", [(10, 3), (203, 2), (5, 8)])
def test_remainder_pad_repeats_first_samples_and_keeps_ranks_equal(n: int, world: int) -> None:
    ranks = [EpochSampler(n, 3, remainder="pad", shard=Shard(r, world)) for r in range(world)]
    sizes = {len(flat(s.batches(0))) for s in ranks}
    assert sizes == {-(-n // world)}
    assert len({len(s) for s in ranks}) == 1
    seen = Counter(i for s in ranks for i in flat(s.batches(0)))
    assert set(seen) == set(range(n))
    assert sum(seen.values()) - n == -(-n // world) * world - n


@pytest.mark.parametrize("n,world", [(10, 3), (203, 2)])
def test_remainder_drop_leaves_out_fewer_than_world_size(n: int, world: int) -> None:
    ranks = [EpochSampler(n, 3, shuffle=True, remainder="drop", shard=Shard(r, world)) for r in range(world)]
    seen = Counter(i for s in ranks for i in flat(s.batches(0)))
    assert max(seen.values()) == 1
    assert n - len(seen) == n % world
    assert len({len(s) for s in ranks}) == 1


def test_empty_dataset_has_no_batches() -> None:
    assert EpochSampler(0, 4).batches(0) == []


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"n": 10, "batch_size": 0}, "batch_size must be >= 1, got 0"),
        ({"n": -1, "batch_size": 2}, "dataset length must be >= 0, got -1"),
        ({"n": 10, "batch_size": 2, "remainder": "wrap"}, "remainder must be 'pad' or 'drop', got 'wrap'"),
    ],
)
def test_bad_settings_name_the_setting(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EpochSampler(**kwargs)


def test_bad_shard_names_rank_and_worker() -> None:
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        Shard(2, 2)
    with pytest.raises(ValueError, match=r"worker=3 must be in \[0, num_workers=3\)"):
        Shard(0, 1, 3, 3)


# -- the block order: contiguous runs of rows, shuffled, mixed within a window ------------------------


def _runs(order: list[int]) -> list[list[int]]:
    """``order`` cut into maximal runs of consecutive row numbers."""
    runs: list[list[int]] = []
    for i in order:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


@pytest.mark.parametrize("n,block,window", [(203, 8, 8), (203, 8, 32), (1000, 64, 256), (7, 64, 1024), (64, 8, 1)])
def test_block_order_is_a_permutation_with_each_block_within_a_window(n: int, block: int, window: int) -> None:
    s = EpochSampler(n, 16, shuffle=True, seed=2, block=block, window=window)
    order = s.order(3).tolist()
    assert sorted(order) == list(range(n))
    pos = {row: p for p, row in enumerate(order)}
    firsts = []
    for b in range(-(-n // block)):  # a block's rows lie within about a window of positions
        span = [pos[i] for i in range(b * block, min(n, (b + 1) * block))]
        assert max(span) - min(span) < 2 * max(window, block)
        firsts.append(min(span))
    assert firsts != sorted(firsts) or n <= block  # blocks come in a random order
    if window <= block:  # each block read whole, in storage order
        assert all(r[0] % block == 0 for r in _runs(order))


def test_block_order_draws_from_about_window_over_block_blocks_at_any_point() -> None:
    order = EpochSampler(20_000, 32, shuffle=True, seed=1, block=64, window=1024).order(0)
    live = []
    first, last = {}, {}
    for p, row in enumerate(order.tolist()):
        first.setdefault(row // 64, p)
        last[row // 64] = p
    ends = sorted(last.values())
    starts = sorted(first.values())
    for p in range(2000, 18000, 500):  # blocks started and not finished at p: the reader's holdings
        live.append(sum(1 for s in starts if s <= p) - sum(1 for e in ends if e < p))
    assert 12 <= min(live) and max(live) <= 24  # ~16 = 1024 / 64, steady


def test_block_order_mixes_a_batch_from_many_blocks_and_changes_with_epoch_and_seed() -> None:
    s = EpochSampler(4096, 32, shuffle=True, seed=1, block=64, window=1024)
    batches = s.batches(0)
    blocks_per_batch = [len({i // 64 for i in b}) for b in batches]
    assert min(blocks_per_batch) >= 8  # 32 rows drawn from 16 blocks: never one run
    assert flat(s.batches(1)) != flat(batches)
    assert flat(EpochSampler(4096, 32, shuffle=True, seed=2, block=64, window=1024).batches(0)) != flat(batches)
    assert flat(EpochSampler(4096, 32, shuffle=True, seed=1, block=64, window=1024).batches(0)) == flat(batches)
    # the blocks themselves come in a random order: the first window is not the first 16 blocks
    assert {i // 64 for i in flat(batches)[:1024]} != set(range(16))


@pytest.mark.parametrize("window", [1024, 4096])
def test_block_order_edges_are_mixed_without_a_crowd_of_blocks_starting_together(window: int) -> None:
    """The first blocks all start at the beginning, each in storage order over its spread (what a reader
    reads of one as it comes due is a contiguous run); no other point of the epoch has more than a few
    blocks starting within a block's positions of each other; the first and last batches are as mixed
    as the rest."""
    n, block = 32_000, 64  # whole batches of 32
    s = EpochSampler(n, 32, shuffle=True, seed=4, block=block, window=window)
    order = s.order(0).tolist()
    first: dict[int, int] = {}
    rows: dict[int, list[int]] = {}
    for p, row in enumerate(order):
        first.setdefault(row // block, p)
        rows.setdefault(row // block, []).append(row)
    opening = [b for b in rows if rows[b] == sorted(rows[b])]  # the others come in a random order
    assert len(opening) == window // block and all(first[b] < window // 4 for b in opening)
    later = sorted(first[b] for b in first if b not in opening)
    crowd = max(sum(1 for q in later[k:] if q - p < block) for k, p in enumerate(later))
    assert crowd <= 6  # ~1 a block's positions, never the old end's window / block at once
    per_batch = [len({i // block for i in b}) for b in s.batches(0)]
    mid = sorted(per_batch)[len(per_batch) // 2]
    assert min(per_batch[:4] + per_batch[-4:]) >= mid // 2


def test_a_window_is_at_most_about_half_the_dataset() -> None:
    """A dataset of under two windows is mixed over about half its rows (so a reader never holds most of
    it at once), down to ``SMALL_WINDOW``: below about twice that it is one mix of all its rows."""
    from asyncload.engine.sampler import SMALL_WINDOW, block_order

    def live_at_start(n: int, window: int) -> int:  # blocks whose first row comes within the first 64
        order = block_order(n, 64, window, np.random.default_rng(0)).tolist()
        return len({i // 64 for i in order[:64]})

    assert live_at_start(4000, 4096) == live_at_start(4000, 4000 // 2 - 64) < 4000 // 64 * 3 // 4
    assert np.array_equal(
        block_order(4000, 64, 4096, np.random.default_rng(1)), block_order(4000, 64, 1936, np.random.default_rng(1))
    )
    n = 2 * SMALL_WINDOW - 200  # under 2 x SMALL_WINDOW: one mix of all, as under two windows always was
    assert np.array_equal(
        block_order(n, 64, 4096, np.random.default_rng(1)), block_order(n, 64, n, np.random.default_rng(1))
    )


def test_block_size_one_is_the_full_shuffle() -> None:
    full = EpochSampler(500, 10, shuffle=True, seed=5)
    assert full.block == 1
    assert flat(EpochSampler(500, 10, shuffle=True, seed=5, block=1, window=4096).batches(2)) == flat(full.batches(2))


@pytest.mark.parametrize("n,world,workers,bs", [(203, 1, 3, 16), (200, 2, 2, 8), (1000, 3, 2, 32)])
def test_block_order_shards_cover_the_epoch_exactly_once(n: int, world: int, workers: int, bs: int) -> None:
    seen: Counter[int] = Counter()
    for r in range(world):
        for w in range(workers):
            s = EpochSampler(n, bs, shuffle=True, seed=1, shard=Shard(r, world, w, workers), block=16, window=64)
            seen.update(flat(s.batches(4)))
    padded = -(-n // world) * world - n  # "pad" repeats the first rows of the order
    assert sum(seen.values()) == n + padded and set(seen) == set(range(n))


def test_bad_block_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="block=0 and window=1 must be >= 1"):
        EpochSampler(10, 2, shuffle=True, block=0)


@pytest.mark.parametrize("shuffle,block", [(False, 1), (True, 1), (True, 64)])
def test_empty_dataset_shuffled_or_not_has_no_batches(shuffle: bool, block: int) -> None:
    """A shuffled order of an empty dataset in blocks used to divide by zero (``block_order``)."""
    s = EpochSampler(0, 4, shuffle=shuffle, block=block, window=1024)
    assert s.order(0).tolist() == [] and s.batches(0) == [] and len(s) == 0
    assert block_order(0, 64, 1024, np.random.default_rng(0)).tolist() == []
