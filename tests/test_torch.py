"""AsyncIterableDataset inside torch DataLoader workers and torch.distributed ranks."""

from __future__ import annotations

import json
import os
import socket
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource

from .conftest import ROWS, WORKER_START, live_children, shuffled, wait_no_loop_threads

pytestmark = pytest.mark.timeout(120)


def batch_indices(loader) -> list[list[int]]:
    return [b["index"].tolist() for b in loader]


def test_no_workers_matches_the_loader(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    ds = AsyncIterableDataset(src, batch_size=16, shuffle=True, seed=3)
    dl = DataLoader(ds, batch_size=None, num_workers=0)
    assert len(dl) == 13
    assert batch_indices(dl) == batch_indices(AsyncLoader(src, batch_size=16, shuffle=True, seed=3))
    wait_no_loop_threads()


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_two_workers_yield_every_sample_once_in_the_same_batch_order(seg_url, context) -> None:
    src = DeepLakeSource(seg_url)
    ds = AsyncIterableDataset(src, batch_size=16, shuffle=True, seed=5, concurrency=32)
    ds.set_epoch(2)
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    got = batch_indices(dl)
    assert got == shuffled(ROWS, 16, 5).batches(2)
    assert len(dl) == len(got) == 13
    b = next(iter(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)))
    assert b["images"].shape == (16, 40, 56, 3) and b["images"].dtype == torch.uint8


def test_early_break_in_worker_dataloader_leaves_no_processes(seg_url) -> None:
    import multiprocessing

    before = set(live_children())  # an earlier test's reader still finishing a read the store holds up
    dl = DataLoader(AsyncIterableDataset(DeepLakeSource(seg_url), batch_size=4), batch_size=None, num_workers=2)
    for n, _ in enumerate(dl):
        if n == 3:
            break
    del dl, _
    import gc
    import time

    gc.collect()
    end = time.monotonic() + 10
    while set(multiprocessing.active_children()) - before and time.monotonic() < end:
        time.sleep(0.05)
    assert not set(live_children()) - before


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {}
        for remainder in ("pad", "drop"):
            ds = AsyncIterableDataset(DeepLakeSource(url), batch_size=8, shuffle=True, seed=11, remainder=remainder)
            ds.set_epoch(1)
            dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)
            batches = [b["index"].tolist() for b in dl]
            result[remainder] = {"batches": batches, "len": len(dl)}
            # Equal batch counts are what keep collectives in step: every rank reaches this all_reduce.
            t = torch.tensor([len(batches)])
            dist.all_reduce(t)
            result[remainder]["total_batches"] = int(t.item())
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_times_two_workers_cover_the_epoch(seg_url, tmp_path) -> None:
    world = 2
    mp.start_processes(
        _rank_main, args=(world, _free_port(), seg_url, str(tmp_path)), nprocs=world, start_method="spawn"
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    order = shuffled(ROWS, 8, 11).order(1).tolist()

    pad = [r["pad"] for r in ranks]
    assert pad[0]["len"] == pad[1]["len"] == len(pad[0]["batches"]) == len(pad[1]["batches"]) == 13
    seen = Counter(i for r in pad for b in r["batches"] for i in b)
    assert set(seen) == set(range(ROWS))
    assert [i for i, c in seen.items() if c > 1] == [order[0]]  # 203 over 2 ranks: one padded repeat
    assert pad[0]["total_batches"] == 26

    drop = [r["drop"] for r in ranks]
    assert len(drop[0]["batches"]) == len(drop[1]["batches"]) == 13
    seen = Counter(i for r in drop for b in r["batches"] for i in b)
    assert max(seen.values()) == 1 and set(range(ROWS)) - set(seen) == {order[-1]}
