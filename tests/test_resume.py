"""Exact mid-epoch resume: AsyncLoader (in and out of order, shards, skips) and DataLoader workers."""

from __future__ import annotations

import pytest
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, ConfigError, DeepLakeSource, Shard

from .conftest import ROWS, shuffled
from .resume import check_resume, ids
from .sources import DelayedSource

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("shuffle", [False, True])
def test_in_order_resume_is_exact(seg_url, shuffle) -> None:
    src = DeepLakeSource(seg_url)
    check_resume(
        lambda: AsyncLoader(src, batch_size=16, shuffle=shuffle, seed=4, concurrency=64, prefetch=3), in_order=True
    )


def test_out_of_order_resume_loses_and_repeats_nothing(seg_url) -> None:
    src = DelayedSource(seg_url, lambda idx: 0.05 if idx[0] % 48 == 0 else 0.0)
    check_resume(lambda: AsyncLoader(src, batch_size=16, shuffle=True, concurrency=64, in_order=False), in_order=False)


def test_sharded_resume(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    shard = Shard(rank=1, world_size=2, worker=0, num_workers=2)
    check_resume(lambda: AsyncLoader(src, batch_size=8, shuffle=True, seed=1, shard=shard), in_order=True, epochs=1)


@pytest.mark.timeout(300)
def test_fanout_processes_resume_through_the_shared_helper(seg_url) -> None:
    """The same save/load checks as every other epoch shape, on ``processes=2`` (persistent workers)."""
    src = DeepLakeSource(seg_url)
    check_resume(lambda: AsyncLoader(src, batch_size=32, shuffle=True, seed=6, processes=2), in_order=True, epochs=1)


def test_state_from_another_order_is_refused_naming_the_option(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    state = AsyncLoader(src, batch_size=16, seed=1).state_dict()
    with pytest.raises(ConfigError, match="state was saved with seed=1, but this loader has seed=2"):
        AsyncLoader(src, batch_size=16, seed=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="state was saved with shuffle=False, but this loader has shuffle=True"):
        AsyncLoader(src, batch_size=16, seed=1, shuffle=True).load_state_dict(state)


def test_another_batch_size_resumes_from_the_rows_consumed(seg_url) -> None:
    """The state names positions of the epoch's order, not batches: a loader with another batch size
    yields exactly the rows not yet taken, in the epoch's order."""
    src = DeepLakeSource(seg_url)
    first = AsyncLoader(src, batch_size=16, shuffle=True, seed=1)
    it = iter(first)
    taken = [i for _ in range(5) for i in next(it)["index"].tolist()]
    state = first.state_dict()
    it.close()
    second = AsyncLoader(src, batch_size=10, shuffle=True, seed=1)
    second.load_state_dict(state)
    rest = ids(list(second))
    assert [len(b) for b in rest] == [10] * 12 + [3]
    assert taken + [i for b in rest for i in b] == shuffled(ROWS, 16, 1).order(0).tolist()


def test_set_epoch_to_another_epoch_drops_the_resume_point(seg_url) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=50)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    loader.load_state_dict(state)
    loader.set_epoch(3)
    assert sum(len(b) for b in ids(list(loader))) == ROWS


@pytest.mark.parametrize("workers", [0, 2])
def test_dataloader_workers_resume_by_batch_count(seg_url, workers) -> None:
    src = DeepLakeSource(seg_url)

    def make() -> AsyncIterableDataset:
        return AsyncIterableDataset(src, batch_size=16, shuffle=True, seed=9)

    ref = shuffled(ROWS, 16, 9).batches(1)
    for k in (0, 5, 13):
        ds = make()
        ds.set_epoch(1)
        dl = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None)
        taken = []
        for b in dl:
            if len(taken) == k:
                break
            taken.append(b["index"].tolist())
        state = ds.state_dict(batches_consumed=k)
        resumed = make()
        resumed.load_state_dict(state)
        resumed.set_epoch(1)
        dl = DataLoader(
            resumed, batch_size=None, num_workers=workers, multiprocessing_context="fork" if workers else None
        )
        assert len(dl) == len(ref)  # the epoch's length, as StatefulDataLoader and Lightning count it
        assert taken + [b["index"].tolist() for b in dl] == ref, f"resumed after {k} batches"


@pytest.mark.timeout(180)
def test_fanout_processes_through_asyncloader_resume_exactly(seg_url) -> None:
    src = DeepLakeSource(seg_url)

    def make() -> AsyncLoader:
        return AsyncLoader(src, batch_size=16, shuffle=True, seed=5, processes=2)

    ref = shuffled(ROWS, 16, 5).batches(0)
    first = make()
    it = iter(first)
    taken = ids([next(it) for _ in range(5)])
    state = first.state_dict()
    it.close()
    assert state["next"] == 5
    second = make()
    second.load_state_dict(state)
    assert taken + ids(list(second)) == ref
