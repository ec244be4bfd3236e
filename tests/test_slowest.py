"""The slowest rank named on rank 0 (``engine.slowest``), with real gloo ranks: one rank given a slower store,
or a slower training step, is named with what it waited on, by ``AsyncLoader.stats()`` and the log, and by
``AsyncIterableDataset`` with DataLoader workers; nothing without a process group."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from asyncload import AsyncIterableDataset, AsyncLoader
from asyncload.engine.slowest import log_line, slowest

from .sources import Rows

N, BATCH = 240, 8


def _rank_main(rank: int, world: int, port: int, slow: str, out: str) -> None:
    """One gloo rank: one epoch with rank ``world - 1`` slowed (``slow``: its store or its step); rank 0
    writes what its ``stats()`` and the log say."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("asyncload").addHandler(handler)
    logging.getLogger("asyncload").setLevel(logging.INFO)
    try:
        slowed = rank == world - 1
        delay = 0.02 if slowed and slow == "store" else 0.0
        if slow == "workers":  # the adapter, its reads in a DataLoader worker
            # 80 ms a read: a batch every ~80 ms, well behind what the training process takes even on a loaded
            # machine. At 30 ms, a suite run once found rank 2's worker waiting on its DataLoader's main
            # process, which then was the slower side and was rightly named ("training").
            ds = AsyncIterableDataset(Rows(N, delay=0.08 if slowed else 0.0), BATCH, processes=0, concurrency=8)
            dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="forkserver")
            n = sum(len(b["x"]) for b in dl)
            ds.set_epoch(1)  # the next epoch: every rank posts the one that ended
            stats = ds.stats()
        else:
            loader = AsyncLoader(Rows(N, delay=delay), batch_size=BATCH, processes=0, concurrency=8)
            n = 0
            for b in loader:
                n += len(b["x"])
                # The training step. Where the slowed rank's step is the slow side, the others' is long enough
                # too (20 ms) that their loaders keep ahead on a loaded machine: a 2 ms step outran a loader
                # there, and that rank was rightly named waiting on data.
                fast = 0.02 if slow == "step" else 0.002
                time.sleep(0.08 if slowed and slow == "step" else fast)
            stats = loader.stats()
            loader.close()
        if rank == 0:
            Path(out).write_text(json.dumps({"n": n, "stats": stats, "lines": lines}, default=str))
    finally:
        dist.destroy_process_group()


def _run(slow: str, tmp_path: Path, world: int = 3) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"{slow}.json"
    mp.start_processes(_rank_main, args=(world, port, slow, str(out)), nprocs=world, start_method="forkserver")
    return json.loads(out.read_text())


@pytest.mark.timeout(180)
@pytest.mark.xdist_group("process_storms")
@pytest.mark.parametrize(("slow", "stage"), [("store", "store"), ("step", "training"), ("workers", "store")])
def test_rank_0_names_the_slowest_rank_and_what_it_waits_on(slow, stage, tmp_path) -> None:
    got = _run(slow, tmp_path)
    st = got["stats"]
    assert st["ranks_reported"] == 3 and st["ranks_not_finished"] == []
    assert st["slowest_rank"] == 2 and st["slowest_rank_waiting_on"] == stage, st
    said = [line for line in got["lines"] if "the slowest of 3 ranks is rank 2" in line]
    assert len(said) == 1 and f"waiting on {stage}" in said[0], got["lines"]


def test_the_verdict_prefers_the_rank_that_waited_for_data() -> None:
    posts = [
        {"rank": 0, "elapsed_s": 10.0, "steady_wait_s": 0.1, "consumer_wait_frac": 0.01, "waiting_on": "training"},
        {"rank": 1, "elapsed_s": 10.2, "steady_wait_s": 4.0, "consumer_wait_frac": 0.40, "waiting_on": "decode"},
        {"rank": 2, "elapsed_s": 10.4, "steady_wait_s": 0.2, "consumer_wait_frac": 0.02, "waiting_on": "training"},
    ]
    found = slowest(posts, [])
    assert (found["slowest_rank"], found["slowest_rank_waiting_on"]) == (1, "decode")
    assert log_line(3, 3, found) == (
        "asyncload: epoch 3: the slowest of 3 ranks is rank 1 (its epoch 10.2 s, the others' 10.0-10.4 s): waiting on "
        "decode, its loop waited for data 40% of its time"
    )
    for p in posts:  # no rank waits for data: the longest epoch is the slowest, its step the slower side
        p["consumer_wait_frac"] = 0.01
    assert slowest(posts, [])["slowest_rank"] == 2
    late = slowest(posts[:2], [2])
    assert late["slowest_rank"] == 2 and late["slowest_rank_waiting_on"] == "unfinished"
    assert "ranks [2] of 3 had not finished the epoch" in log_line(0, 3, late)


def test_without_a_process_group_no_rank_figures() -> None:
    loader = AsyncLoader(Rows(40), batch_size=BATCH, processes=0)
    assert sum(len(b["x"]) for b in loader) == 40
    assert "slowest_rank" not in loader.stats() and loader._board is None
    loader.close()
