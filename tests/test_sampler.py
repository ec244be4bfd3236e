"""The epoch plan: order, seeds, epochs, shards, remainder policy, batch counts."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from asyncload import EpochSampler, Shard


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
