"""AsyncLoader on a real local Deep Lake dataset: order, batches, shuffling, bounds, output."""

from __future__ import annotations

import math
import threading
import time
import warnings

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, DeepLakeSource

from .conftest import ROWS, loop_threads, shuffled, wait_no_loop_threads
from .sources import DelayedSource

pytestmark = pytest.mark.timeout(60)


def indices(loader) -> list[int]:
    return [i for b in loader for i in b["index"].tolist()]


@pytest.mark.parametrize("read_mode", ["column", "row"])
def test_sequential_order_and_content_equal_the_dataset(seg_url, seg_arrays, read_mode) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=16, read_mode=read_mode, in_order=True)
    got = {"images": [], "masks": [], "index": []}
    for b in loader:
        for k in got:
            got[k].append(b[k])
    assert torch.cat(got["index"]).tolist() == list(range(ROWS))
    assert np.array_equal(torch.cat(got["images"]).numpy(), seg_arrays["images"])
    assert np.array_equal(torch.cat(got["masks"]).numpy(), seg_arrays["masks"])
    assert got["images"][0].shape == (16, 40, 56, 3) and got["images"][0].dtype == torch.uint8
    assert got["masks"][0].shape == (16, 40, 56)


def test_batch_sizes_last_batch_and_len(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    keep = AsyncLoader(src, batch_size=32)
    assert [len(b["index"]) for b in keep] == [32] * 6 + [11]
    assert len(keep) == 7
    drop = AsyncLoader(src, batch_size=32, drop_last=True)
    assert [len(b["index"]) for b in drop] == [32] * 6
    assert len(drop) == 6


def test_shuffled_epochs_are_seeded_permutations(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    a = AsyncLoader(src, batch_size=10, shuffle=True, seed=7)
    e0 = indices(a)
    a.set_epoch(1)
    e1 = indices(a)
    b = AsyncLoader(src, batch_size=10, shuffle=True, seed=7)
    assert sorted(e0) == sorted(e1) == list(range(ROWS))
    assert e0 != list(range(ROWS)) and e0 != e1
    assert indices(b) == e0
    b.set_epoch(1)
    assert indices(b) == e1
    assert indices(AsyncLoader(src, batch_size=10, shuffle=True, seed=8)) != e0


def test_epoch_repeats_until_set_epoch(seg_url) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=50, shuffle=True, seed=1)
    assert indices(loader) == indices(loader)


def test_completion_order_yields_every_sample_once_out_of_order(seg_url) -> None:
    # Batches whose first index is a multiple of 32 are slow: later batches overtake them.
    src = DelayedSource(seg_url, lambda idx: 0.3 if idx[0] % 32 == 0 else 0.0)
    loader = AsyncLoader(src, batch_size=16, concurrency=64, in_order=False)
    got = indices(loader)
    assert sorted(got) == list(range(ROWS))
    assert got != list(range(ROWS))
    in_order = AsyncLoader(src, batch_size=16, concurrency=64, in_order=True)
    assert indices(in_order) == list(range(ROWS))


@pytest.mark.parametrize("concurrency", [1, 8, 256])
@pytest.mark.parametrize("read_mode", ["column", "row"])
def test_any_concurrency_gives_the_same_batches(seg_url, concurrency, read_mode) -> None:
    loader = AsyncLoader(
        DeepLakeSource(seg_url), batch_size=24, shuffle=True, seed=2, concurrency=concurrency, read_mode=read_mode
    )
    assert [b["index"].tolist() for b in loader] == shuffled(ROWS, 24, 2).batches(0)


@pytest.mark.parametrize("read_mode,per_request", [("row", 1), ("column", 8)])
def test_samples_in_flight_never_exceed_concurrency(seg_url, read_mode, per_request) -> None:
    src = DelayedSource(seg_url, lambda idx: 0.01)
    # hedge=None: a hedged second request is the one read allowed beyond the limit (README), and on a
    # loaded machine a 10 ms read can look like a straggler.
    loader = AsyncLoader(src, batch_size=8, concurrency=24, read_mode=read_mode, hedge=None)
    assert sorted(indices(loader)) == list(range(ROWS))
    assert src.max_samples_in_flight <= 24
    assert src.max_in_flight == 24 // per_request  # the fan-out is actually used


def test_prefetch_bounds_what_is_held_ahead_of_a_slow_consumer(seg_url) -> None:
    batch, concurrency, prefetch = 8, 16, 3
    bound = (prefetch + math.ceil(concurrency / batch) + 1) * batch
    loader = AsyncLoader(
        DeepLakeSource(seg_url), batch_size=batch, concurrency=concurrency, prefetch=prefetch, processes=0
    )
    it = iter(loader)
    ahead = []
    for _ in it:
        time.sleep(0.03)
        s = loader.stats()
        ahead.append(s["samples_read"] - s["samples_yielded"])
    assert max(ahead) <= bound
    assert max(ahead) >= prefetch * batch  # prefetch really runs ahead


def test_consumer_waits_without_spinning(seg_url) -> None:
    src = DelayedSource(seg_url, lambda idx: 1.0)
    loader = AsyncLoader(src, batch_size=4, concurrency=4)
    it = iter(loader)
    c0, t0 = time.process_time(), time.perf_counter()
    next(it)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    it.close()
    assert wall >= 0.9
    assert cpu < 0.2 * wall, f"{cpu:.3f}s CPU while waiting {wall:.3f}s"
    assert loader.stats()["consumer_wait_s"] >= 0.9


def test_batches_are_writable_tensors_without_warnings(seg_url) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        b = next(iter(AsyncLoader(DeepLakeSource(seg_url), batch_size=4)))
        b["images"][0, 0, 0, 0] = 7
        b["masks"] += 1
    assert b["images"][0, 0, 0, 0].item() == 7


def test_transform_and_collate_fn(seg_url, seg_arrays) -> None:
    def transform(s):
        return {"x": s["images"].astype(np.float32).mean(), "m": int(s["masks"].max()), "index": s["index"]}

    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=10, transform=transform)
    first = next(iter(loader))
    assert first["index"].tolist() == list(range(10))
    assert torch.allclose(
        first["x"], torch.tensor(seg_arrays["images"][:10].reshape(10, -1).astype(np.float32).mean(1))
    )
    assert first["m"].tolist() == seg_arrays["masks"][:10].reshape(10, -1).max(1).tolist()

    seen = []
    loader = AsyncLoader(
        DeepLakeSource(seg_url), batch_size=10, collate_fn=lambda samples: [s["index"] for s in samples]
    )
    for b in loader:
        seen += b
    assert seen == list(range(ROWS))


def test_without_index_and_with_one_column(seg_url) -> None:
    b = next(iter(AsyncLoader(DeepLakeSource(seg_url, columns=("masks",)), batch_size=3, with_index=False)))
    assert set(b) == {"masks"}


def test_loop_thread_starts_on_first_next_and_ends_with_the_epoch(seg_url) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=64, processes=0)
    it = iter(loader)
    assert not loop_threads()
    next(it)
    assert [t.name for t in loop_threads() if t.name == "asyncload-loop"] == ["asyncload-loop"]
    assert threading.current_thread().name not in {t.name for t in loop_threads()}
    list(it)
    wait_no_loop_threads()


def test_stats_count_the_epoch(seg_url) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=50, concurrency=50)
    list(loader)
    s = loader.stats()
    assert s["samples_yielded"] == s["samples_read"] == ROWS
    assert s["batches_yielded"] == 5 and s["in_flight"] == 0 and s["ready_batches"] == 0
    assert s["read_p50_ms"] is not None and s["read_p50_ms"] <= s["read_p99_ms"]
    assert s["samples_per_s"] > 0 and s["time_to_first_batch_s"] is not None
