"""Fan-out: K worker processes yield exactly one AsyncLoader's batches; ``AsyncLoader(processes=K)`` keeps
the same workers across epochs; crashes, errors, ``break``, close, garbage collection and interpreter exit
end with every worker joined (or idle and reusable, for an abandoned epoch) and nothing left in /dev/shm.

Each worker is a spawned process that imports torch and deeplake (~2-3 s of CPU), so the tests keep K
small and check several things per epoch. Transforms and collate functions live at module level: worker
processes unpickle them by name.
"""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from asyncload import (
    AsyncLoader,
    ConfigError,
    DeepLakeSource,
    EpochSampler,
    ReaderCrashError,
    ReadError,
    Shard,
    WorkerError,
)
from asyncload.engine.protocol import Failure
from asyncload.errors import LoaderClosedError, read_error
from asyncload.processes.fanout import WorkerPool, sub_shard

from .conftest import (
    ROWS,
    forked_workers,
    live_children,
    loop_threads,
    no_children_left,
    wait_no_loop_threads,
    worker_pids,
)
from .sources import CrashingSource

OPTS: dict[str, Any] = {"batch_size": 16, "shuffle": True, "seed": 5}


# -- run in the workers ----------------------------------------------------------------------------
def heavy(sample: dict[str, Any]) -> dict[str, Any]:
    """CPU-bound and deterministic: the same output in any process."""
    img = sample["images"].astype(np.float32)
    for _ in range(10):
        img = np.sqrt(img * img + 1.0)
    return {"images": img, "masks": sample["masks"], "index": sample["index"]}


@dataclass
class Pair:
    """A custom collate output that is not a dict of tensors."""

    pixels: torch.Tensor
    masks: np.ndarray
    indices: list[int]


def pair_collate(samples: list[dict[str, Any]]) -> Pair:
    return Pair(
        torch.stack([torch.from_numpy(s["images"]) for s in samples]),
        np.stack([s["masks"] for s in samples]),
        [int(s["index"]) for s in samples],
    )


def empty_batch_5(sample: dict[str, Any]) -> dict[str, Any]:
    """Fails every sample of batch 5 (indices 80-95 with batch_size 16, in order)."""
    if 80 <= sample["index"] < 96:
        raise ValueError("unreadable")
    return sample


def slow_while_flagged(sample: dict[str, Any]) -> dict[str, Any]:
    """Stalls every sample after the first two batches of 8 in workers spawned while the flag was set."""
    if os.environ.get("ASYNCLOAD_TEST_STALL") and sample["index"] >= 16:
        time.sleep(30)
    return sample


def fail_at_85(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["index"] == 85:
        raise ValueError("bad pixel at 85")
    return sample


def killed_while_allocating_at_85(sample: dict[str, Any]) -> dict[str, Any]:
    """Dies as torch's allocator can leave a worker killed mid-allocation: its shm file made, not unlinked."""
    if sample["index"] == 85:
        with open(f"/dev/shm/torch_{os.getpid()}_0_0", "wb") as f:
            f.truncate(1 << 20)
        os.kill(os.getpid(), signal.SIGKILL)
    return sample


# -- helpers ---------------------------------------------------------------------------------------
def worker_shm(pids: Any) -> list[str]:
    """/dev/shm entries made by torch in these processes (``torch_<pid>_...``)."""
    return [e for e in os.listdir("/dev/shm") if any(e.startswith(f"torch_{pid}_") for pid in pids)]


def lasting_worker_shm(pids: Any, wait_s: float = 0.5) -> list[str]:
    """Entries of live workers that are still there ``wait_s`` later. torch creates a batch's file and
    unlinks it right after mapping it, so a snapshot can catch one mid-allocation; each name is used once,
    so a name seen twice is one left behind."""
    first = set(worker_shm(pids))
    time.sleep(wait_s)
    return sorted(first & set(worker_shm(pids)))


def assert_gone(pids: Any) -> None:
    assert no_children_left() and not forked_workers()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert worker_shm(pids) == []


def orphaned_shm(before: set[str]) -> list[str]:
    """``/dev/shm`` entries made by torch (``torch_<pid>_...``) since ``before`` whose process is gone:
    left behind by a worker that died (another process's live ones are in use)."""
    left = []
    for name in set(os.listdir("/dev/shm")) - before:
        pid = name.split("_")[1] if name.startswith("torch_") else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            left.append(name)
    return left


def assert_held_exactly(err: WorkerError, plan: list[list[int]], got: list[list[int]]) -> None:
    """After worker 1 of 2 was killed with batches 0 and 1 taken: the batches yielded after the kill are the
    next ones in order (worker 1's, sent before it died, may be among them: at most its 2 credits), and
    the error names exactly the indices of worker 1's batches that never arrived."""
    assert got == plan[2 : 2 + len(got)] and len(got) <= 5
    held = [j for j in range(3, len(plan), 2) if j >= 2 + len(got)]
    assert err.indices == [i for j in held for i in plan[j]]
    assert str(plan[held[0]][:4])[1:-1] in str(err) and f"holding {len(held)} undelivered batches" in str(err)


def assert_same_batch(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# -- no processes ----------------------------------------------------------------------------------
@pytest.mark.timeout(10)
@pytest.mark.parametrize("world_size,rank,num_workers,worker", [(1, 0, 1, 0), (3, 2, 2, 1), (2, 0, 3, 2)])
@pytest.mark.parametrize("processes", [1, 2, 3, 5])
def test_round_robin_over_sub_shards_is_the_shard(world_size, rank, num_workers, worker, processes) -> None:
    """The identity the fan-out rests on: worker k's sub-shard holds batches k, k+K, ... of the shard."""
    for n, bs, drop_last, remainder in itertools.product([0, 1, 37, 203], [1, 16], [False, True], ["pad", "drop"]):
        shard = Shard(rank, world_size, worker, num_workers)
        opts = {"shuffle": True, "seed": 3, "drop_last": drop_last, "remainder": remainder}
        whole = EpochSampler(n, bs, shard=shard, **opts).batches(2)
        parts = [EpochSampler(n, bs, shard=sub_shard(shard, k, processes), **opts).batches(2) for k in range(processes)]
        merged = [parts[j % processes][j // processes] for j in range(sum(map(len, parts)))]
        assert merged == whole, (n, bs, drop_last, remainder)


@pytest.mark.timeout(30)
def test_bad_settings_are_refused_before_any_process_starts(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    before = set(multiprocessing.active_children())  # readers of earlier tests' loaders not yet collected
    with pytest.raises(ConfigError, match="context='fork' is not allowed: forking"):
        WorkerPool(src, OPTS, Shard(), 2, context="fork")
    with pytest.raises(ConfigError, match="mp_context='fork' is not allowed"):
        AsyncLoader(src, **OPTS, processes=2, mp_context="fork")
    with pytest.raises(ConfigError, match="processes=0"):
        WorkerPool(src, OPTS, Shard(), 0)
    with pytest.raises(ConfigError, match="batch_size=0"):
        AsyncLoader(src, batch_size=0, processes=2)
    with pytest.raises(ConfigError, match="pickled"):
        iter(AsyncLoader(src, **OPTS, transform=lambda s: s, processes=2))
    assert set(multiprocessing.active_children()) <= before
    # The shared-memory allocator is a worker's setting only: this process still collates on the heap
    # (its reads in the default reader process: a Deep Lake read here can crash the test process).
    with AsyncLoader(src, batch_size=4) as loader:
        assert loader.processes == 1 and not next(iter(loader))["images"].is_shared()


@pytest.mark.timeout(10)
def test_a_typed_read_error_keeps_both_types_across_processes() -> None:
    err = read_error("file:///data/seg", "images", [3, 4], KeyError("chunk 7"))
    back = pickle.loads(pickle.dumps(Failure(err))).raise_in("fan-out worker 1 of 2 (pid 1)")
    assert isinstance(back, ReadError) and isinstance(back, KeyError)
    assert str(back) == str(err) and back.indices == [3, 4] and back.column == "images"
    assert "fan-out worker 1 of 2" in back.__notes__[-1]


# -- real worker processes -------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [1, 2, 3])
def test_every_sample_once_and_in_order_the_same_batches_as_one_loader(seg_url, processes) -> None:
    src = DeepLakeSource(seg_url)
    ref = list(AsyncLoader(src, **OPTS, processes=0))
    with AsyncLoader(src, **OPTS, processes=processes) as loader, iter(loader) as it:
        assert len(it) == len(ref)
        got = list(it)
        pids = worker_pids().values()
        assert len(pids) == processes
    assert len(got) == len(ref)
    for a, b in zip(got, ref, strict=True):
        assert_same_batch(a, b)
    # Pixels arrived through shared memory (mapped, not pickled), yet writable like any batch.
    assert all(t.is_shared() for t in got[0].values())
    got[0]["images"][0, 0, 0, 0] = 1
    assert_gone(pids)

    with AsyncLoader(src, **OPTS, processes=processes, in_order=False) as loader:
        any_order = [b["index"].tolist() for b in loader]
    assert sorted(i for b in any_order for i in b) == list(range(ROWS))
    assert sorted(any_order) == sorted(b["index"].tolist() for b in ref)
    assert not live_children()


@pytest.mark.timeout(90)
def test_cpu_heavy_transform_and_custom_collate_give_what_one_loader_gives(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    opts = {**OPTS, "transform": heavy, "collate_fn": pair_collate}
    ref = list(AsyncLoader(src, **opts, processes=0))
    with AsyncLoader(src, **opts, processes=2) as loader:
        got = list(loader)
    assert [type(b) for b in got] == [Pair] * len(ref)
    for a, b in zip(got, ref, strict=True):
        assert a.indices == b.indices
        assert torch.equal(a.pixels, b.pixels) and a.pixels.dtype == torch.float32
        assert np.array_equal(a.masks, b.masks)
    assert not live_children()


@pytest.mark.timeout(60)
def test_skip_leaves_out_the_consumed_batches(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    ref = [b["index"].tolist() for b in AsyncLoader(src, **OPTS, processes=0)]
    skip = frozenset({0, 1, 2, 5, len(ref) - 1})
    with AsyncLoader(src, **OPTS, processes=2) as loader:
        loader.load_state_dict({**loader.state_dict(), "next": 3, "extra": [5, len(ref) - 1]})  # a resume
        it = iter(loader)
        assert len(it) == len(ref) - len(skip)
        got = [b["index"].tolist() for b in it]
    assert got == [b for j, b in enumerate(ref) if j not in skip]


@pytest.mark.timeout(60)
def test_a_batch_left_out_whole_by_on_error_skip_keeps_the_order(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    opts = {"batch_size": 16, "transform": empty_batch_5, "on_error": "skip"}
    ref = [b["index"].tolist() for b in AsyncLoader(src, **opts, processes=0)]
    assert len(ref) == 12 and [80] not in [b[:1] for b in ref]
    with AsyncLoader(src, **opts, processes=2) as loader:
        assert [b["index"].tolist() for b in loader] == ref


@pytest.mark.timeout(180)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_row_that_always_kills_its_worker_is_narrowed_down_and_named_by_the_shared_policy(seg_url, on_error) -> None:
    """The fan-out's batch read alone after a death is narrowed by halves (``recovery.narrow``, as the reader
    process does) to the row that kills two fresh workers alone: named, or left out and counted."""
    bad = 21  # batch 5 of 4 rows (20-23), worker 1's
    src = CrashingSource(seg_url, {bad}, sig=signal.SIGSEGV)
    plan = EpochSampler(ROWS, 4).batches(0)
    got: list[int] = []
    with AsyncLoader(src, batch_size=4, on_error=on_error, processes=2) as loader, iter(loader) as it:
        if on_error == "raise":
            with pytest.raises(ReaderCrashError) as info:
                for b in it:
                    got += b["index"].tolist()
            err = info.value
            assert err.indices == [bad] and err.signal == "SIGSEGV" and err.source == src.url
            assert f"reading row {bad} of {src.url} killed its reader process (SIGSEGV)" in str(err)
            assert got == [i for b in plan[:5] for i in b]  # every batch before its own, in order
        else:
            got = [i for b in it for i in b["index"].tolist()]
            stats = it.stats()
            assert sorted(got) == [i for i in range(ROWS) if i != bad]
            assert stats.skipped == 1 and stats.skipped_samples[0][0] == bad
            assert "killed its reader process (SIGSEGV)" in stats.skipped_samples[0][1]
        pids = worker_pids().values()  # the workers now, replacements included
    assert_gone(pids)


@pytest.mark.timeout(60)
def test_a_killed_worker_ends_the_epoch_with_worker_error_naming_it(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    opts = {"batch_size": 8, "max_restarts": 0}  # the first death is fatal: what this test checks
    plan = EpochSampler(ROWS, 8).batches(0)
    loader = AsyncLoader(src, **opts, processes=2)
    it = iter(loader)
    assert next(it)["index"].tolist() == plan[0]
    assert next(it)["index"].tolist() == plan[1]
    pids = worker_pids()
    assert lasting_worker_shm(pids.values()) == []  # file_descriptor sharing: shm files are unlinked at birth
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    got = []
    with pytest.raises(WorkerError) as info:
        for b in it:
            got.append(b["index"].tolist())
    assert time.monotonic() - t0 < 10  # seconds (a fraction of one when the machine is idle)
    err = info.value
    assert f"worker 1 of 2 (pid {pids[1]})" in str(err) and "killed by signal SIGKILL" in str(err)
    assert err.pid == pids[1] and err.exitcode == -signal.SIGKILL
    assert_held_exactly(err, plan, got)
    assert_gone(pids.values())


@pytest.mark.timeout(60)
def test_a_worker_killed_mid_allocation_leaves_no_shm_file(seg_url) -> None:
    """torch unlinks a batch's shm file right after creating it; SIGKILL in between leaves the file (a CI
    run caught one). The pool removes what a worker that did not exit cleanly left."""
    opts = {"batch_size": 16, "transform": killed_while_allocating_at_85, "max_restarts": 0}
    shm_before = set(os.listdir("/dev/shm"))
    loader = AsyncLoader(DeepLakeSource(seg_url), **opts, processes=2)
    it = iter(loader)
    got = []
    with pytest.raises(WorkerError) as info:  # reading ahead, worker 1 may die before batch 0 arrives
        for b in it:
            got.append(b["index"][0].item())
    dead = info.value.pid
    assert re.search(rf"worker 1 of 2 \(pid {dead}\) for \S+ was killed by signal SIGKILL", str(info.value))
    assert got == [0, 16, 32, 48, 64][: len(got)]  # worker 1 died making batch 5
    assert_gone([dead])
    assert orphaned_shm(shm_before) == []  # worker 0, stopped with the pool, left none either


@pytest.mark.timeout(60)
def test_an_exception_in_a_workers_transform_surfaces_in_order_with_its_message(seg_url) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=16, transform=fail_at_85, processes=2)
    got = []
    with pytest.raises(ValueError, match="bad pixel at 85") as info:
        for b in loader:
            got.append(b["index"][0].item())
    assert got == [0, 16, 32, 48, 64]  # the batches before batch 5 (indices 80-95), which worker 1 failed
    notes = "\n".join(info.value.__notes__)
    pids = worker_pids()  # the workers stay usable after an exception in one
    assert f"fan-out worker 1 of 2 (pid {pids[1]})" in notes and "fail_at_85" in notes
    loader.close()
    assert_gone(pids.values())


@pytest.mark.timeout(60)
def test_break_and_garbage_collection_leave_no_processes(seg_url) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=8, processes=2, mp_context="forkserver")
    for n, _ in enumerate(loader):
        if n == 2:
            break
    pids = list(worker_pids().values())
    assert len(pids) == 2 and sorted(forked_workers()) == sorted(pids)
    del loader, _
    gc.collect()
    assert_gone(pids)


INTERRUPT_SCRIPT = """
import multiprocessing, os, signal, sys, threading, time
from asyncload import AsyncLoader, DeepLakeSource

def slow(sample):
    time.sleep(0.05)  # the epoch lasts seconds: Ctrl-C comes while the parent waits for a batch
    return sample

if __name__ == "__main__":
    # Python's Ctrl-C handler, whatever this process inherited: a suite started from a background job
    # (nohup, `&`) passes SIGINT on ignored, and the KeyboardInterrupt under test would never come.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    src = DeepLakeSource(sys.argv[1])
    workers = lambda: [p.pid for p in multiprocessing.active_children() if p.name.startswith("asyncload-fanout-")]
    it = iter(AsyncLoader(src, batch_size=4, transform=slow, processes=2))
    next(it)
    print("pids", *workers(), flush=True)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        for _ in it:
            pass
    except KeyboardInterrupt:
        print("interrupted; children left:", len(multiprocessing.active_children()), flush=True)
    left_open = iter(AsyncLoader(src, batch_size=4, processes=2))
    next(left_open)
    print("pids", *workers(), flush=True)
    opened = set(workers())
    idle = AsyncLoader(src, batch_size=16, processes=2)  # a persistent pool, idle between epochs at exit
    list(idle)
    print("pids", *(set(workers()) - opened), flush=True)
    print("exiting with an epoch open", flush=True)
"""


@pytest.mark.timeout(90)
def test_ctrl_c_and_interpreter_exit_stop_every_worker(seg_url, tmp_path) -> None:
    script = tmp_path / "interrupt.py"
    script.write_text(textwrap.dedent(INTERRUPT_SCRIPT))
    p = subprocess.run([sys.executable, str(script), seg_url], capture_output=True, text=True, timeout=80)
    out = p.stdout + p.stderr[-3000:]
    assert p.returncode == 0, out
    assert "interrupted; children left: 0" in p.stdout and "exiting with an epoch open" in p.stdout, out
    pids = [int(x) for line in p.stdout.splitlines() if line.startswith("pids ") for x in line.split()[1:]]
    assert len(pids) == 6
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert worker_shm(pids) == []


# -- persistent workers: AsyncLoader(processes=K) ----------------------------------------------------
def epoch_of(loader: AsyncLoader, epoch: int) -> tuple[list[Any], dict[int, int]]:
    """All batches of ``epoch`` and the pids of the workers alive after it (the ones that served it)."""
    loader.set_epoch(epoch)
    batches = list(loader)
    return batches, worker_pids()


def index_lists(batches: list[Any]) -> list[list[int]]:
    return [b["index"].tolist() for b in batches]


def assert_exactly_once(batches: list[Any]) -> None:
    """The exact multiset of "index" values of an epoch: every row once, none twice."""
    assert sorted(i for b in index_lists(batches) for i in b) == list(range(ROWS))


@pytest.mark.timeout(120)
def test_the_same_workers_serve_three_epochs_each_exactly_once_as_one_process_would(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    one = AsyncLoader(src, **OPTS, processes=0)
    earlier = {p.pid for p in multiprocessing.active_children()}  # (an earlier test's, not yet collected)
    with AsyncLoader(src, **OPTS, processes=2) as loader:
        orders, seen_pids = [], []
        for epoch in range(3):
            got, pids = epoch_of(loader, epoch)
            one.set_epoch(epoch)
            ref = list(one)
            assert len(got) == len(ref) == len(loader)
            for a, b in zip(got, ref, strict=True):  # the processes=0 batch sequence, pixels included
                assert_same_batch(a, b)
            assert_exactly_once(got)
            orders.append(index_lists(got))
            seen_pids.append(pids)
            # stats() adds up the workers' figures instead of reporting zeros.
            st = loader.stats()
            assert (st["epoch"], st["samples_yielded"], st["batches_yielded"]) == (epoch, ROWS, len(ref))
            assert st["samples_read"] == ROWS and st["requests"] > 0 and st["samples_per_s"] > 0
            assert st["time_to_first_batch_s"] is not None
        assert len(seen_pids[0]) == 2 and seen_pids[0] == seen_pids[1] == seen_pids[2]
        assert orders[0] != orders[1] != orders[2] != orders[0]  # set_epoch reshuffles
        started = {p.pid for p in multiprocessing.active_children()} - earlier
        assert sorted(started) == sorted(seen_pids[0].values())  # its two workers, and no reader process
    assert_gone(seen_pids[0].values())


@pytest.mark.timeout(120)
def test_out_of_order_epochs_on_persistent_workers_are_exact_and_change_with_set_epoch(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    ref = {e: sorted(map(tuple, index_lists(epoch_of(AsyncLoader(src, **OPTS, processes=0), e)[0]))) for e in (0, 1)}
    loader = AsyncLoader(src, **OPTS, processes=2, in_order=False)
    got0, pids0 = epoch_of(loader, 0)
    got1, pids1 = epoch_of(loader, 1)
    assert pids0 == pids1
    for e, got in ((0, got0), (1, got1)):
        assert_exactly_once(got)
        assert sorted(map(tuple, index_lists(got))) == ref[e]  # the same batches, in any order
    assert ref[0] != ref[1]
    # Out of order too, an epoch abandoned with batches in flight leaks none into the next one.
    loader.set_epoch(0)
    it = iter(loader)
    taken = [next(it), next(it)]
    it.close()
    assert all(tuple(b) in ref[0] for b in index_lists(taken))
    got1, again = epoch_of(loader, 1)
    assert sorted(map(tuple, index_lists(got1))) == ref[1] and again == pids0
    loader.close()
    assert_gone(pids0.values())


@pytest.mark.timeout(120)
def test_an_abandoned_epoch_leaves_the_workers_idle_and_none_of_its_batches_reaches_the_next(seg_url) -> None:
    """break, close() before and after the first batch, garbage collection and a second iter() over an
    open one: each time the next epoch is exactly the one-process epoch, on the same workers."""
    src = DeepLakeSource(seg_url)
    opts = {**OPTS, "batch_size": 8}  # 26 batches: plenty read ahead and in the pipes when abandoned
    one = AsyncLoader(src, **opts, processes=0)
    ref = {e: index_lists(epoch_of(one, e)[0]) for e in range(4)}
    loader = AsyncLoader(src, **opts, processes=2)
    loader.set_epoch(0)
    it = iter(loader)
    assert index_lists([next(it) for _ in range(3)]) == ref[0][:3]
    pids = worker_pids()
    it.close()  # abandoned with both workers' credits spent and their next batches in the pipes
    got, again = epoch_of(loader, 1)
    assert index_lists(got) == ref[1] and again == pids

    loader.set_epoch(2)
    for n, _ in enumerate(loader):  # break + garbage collection
        if n == 4:
            break
    del _
    gc.collect()
    got, again = epoch_of(loader, 3)
    assert index_lists(got) == ref[3] and again == pids

    loader.set_epoch(0)
    iter(loader).close()  # closed before its first next(): the workers were never asked
    first = iter(loader)
    next(first)
    loader.set_epoch(2)
    second = iter(loader)  # a new epoch closes the open one
    with pytest.raises(LoaderClosedError):  # stopped, not finished: never StopIteration
        next(first)
    assert index_lists(list(second)) == ref[2] and worker_pids() == pids
    loader.close()
    assert_gone(pids.values())


@pytest.mark.timeout(120)
def test_resume_mid_epoch_on_the_same_persistent_workers(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    ref = {e: index_lists(epoch_of(AsyncLoader(src, **OPTS, processes=0), e)[0]) for e in (1, 2)}
    loader = AsyncLoader(src, **OPTS, processes=2)
    loader.set_epoch(1)
    it = iter(loader)
    taken = index_lists([next(it) for _ in range(5)])
    state = loader.state_dict()
    pids = worker_pids()
    it.close()
    assert (state["epoch"], state["next"]) == (1, 5)
    loader.load_state_dict(state)  # on the same loader: its workers stay
    loader.set_epoch(1)  # what a training loop does after loading a checkpoint
    rest = iter(loader)
    assert len(rest) == len(ref[1]) - 5
    assert taken + index_lists(list(rest)) == ref[1]
    assert worker_pids() == pids
    got, again = epoch_of(loader, 2)  # the next epoch is whole again: the skip was one epoch's message
    assert index_lists(got) == ref[2] and again == pids
    # Out of order, the state may hold a later batch without an earlier one: the workers skip exactly those.
    state = {**state, "next": 2, "extra": [4, 7, 8]}
    loader.load_state_dict(state)
    skip = {0, 1, 4, 7, 8}
    assert index_lists(list(loader)) == [b for j, b in enumerate(ref[1]) if j not in skip]
    loader.close()
    assert_gone(pids.values())


@pytest.mark.timeout(120)
def test_a_worker_killed_in_the_second_epoch_is_named_and_the_next_epoch_starts_fresh_workers(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    opts = {"batch_size": 8, "max_restarts": 0}
    plan = EpochSampler(ROWS, 8).batches(0)
    loader = AsyncLoader(src, **opts, processes=2)
    _, pids = epoch_of(loader, 0)
    it = iter(loader)
    assert index_lists([next(it), next(it)]) == plan[:2]
    assert worker_pids() == pids
    os.kill(pids[1], signal.SIGKILL)
    got = []
    with pytest.raises(WorkerError) as info:
        for b in it:
            got.append(b["index"].tolist())
    err = info.value
    assert f"worker 1 of 2 (pid {pids[1]})" in str(err) and "killed by signal SIGKILL" in str(err)
    assert (err.worker, err.pid, err.exitcode) == (1, pids[1], -signal.SIGKILL)
    assert_held_exactly(err, plan, got)
    assert_gone(pids.values())  # the pool lost a worker: all of it is stopped
    got, fresh = epoch_of(loader, 0)
    assert index_lists(got) == plan and set(fresh.values()).isdisjoint(pids.values())
    loader.close()
    assert_gone(fresh.values())


@pytest.mark.timeout(120)
def test_an_exception_in_a_worker_leaves_the_workers_reusable(seg_url) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=16, transform=fail_at_85, processes=2)
    seen_pids = []
    for _ in range(2):
        it = iter(loader)
        got = []
        with pytest.raises(ValueError, match="bad pixel at 85"):
            for b in it:
                got.append(b["index"][0].item())
        assert got == [0, 16, 32, 48, 64]
        seen_pids.append(worker_pids())
    assert len(seen_pids[0]) == 2 and seen_pids[0] == seen_pids[1]  # the second epoch ran on the same workers
    loader.close()
    assert_gone(seen_pids[0].values())


@pytest.mark.timeout(120)
def test_close_with_and_garbage_collection_leave_no_process_thread_or_shared_memory(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    me = os.getpid()
    with AsyncLoader(src, batch_size=16, processes=2) as loader:
        _, pids = epoch_of(loader, 0)
        kept = next(iter(loader))  # a batch the consumer keeps outlives the workers
    assert_gone(pids.values())
    assert worker_shm([me]) == [] and not loop_threads()
    assert kept["images"].is_shared() and kept["index"].tolist() == list(range(16))

    loader = AsyncLoader(src, batch_size=16, processes=2)
    it = iter(loader)
    next(it)
    pids = worker_pids()
    loader.close()  # with an epoch open
    with pytest.raises(LoaderClosedError, match=r"was closed while this epoch was being read \(1 of 13 batches"):
        next(it)
    assert_gone(pids.values())
    _, pids = epoch_of(loader, 1)  # a closed loader starts new workers when iterated again
    assert len(pids) == 2
    del loader, it
    gc.collect()  # the loader (and its pool) collected: weakref.finalize stops the workers
    assert_gone(pids.values())

    loader = AsyncLoader(src, batch_size=16, processes=2)
    it = iter(loader)
    next(it)  # an epoch open, and referenced only by the loader's weak pointer once ``it`` goes
    pids = worker_pids()
    del loader, it
    gc.collect()
    assert_gone(pids.values())
    wait_no_loop_threads()
    assert worker_shm([me, *pids.values()]) == []


@pytest.mark.timeout(120)
def test_workers_that_cannot_settle_an_abandoned_epoch_are_replaced_and_the_next_epoch_is_exact(
    seg_url, monkeypatch, caplog
) -> None:
    """The fallback when cancelling cannot be made prompt (a transform stuck in a worker): the pool is
    stopped after 2 x shutdown_timeout and the next epoch runs on fresh workers, none of the old batches."""
    monkeypatch.setenv("ASYNCLOAD_TEST_STALL", "1")  # inherited by the workers spawned now
    # One batch's reads at a time and CPU threads to spare: batches 0 and 1 never queue behind a stalled one.
    opts = {"batch_size": 8, "concurrency": 8, "prefetch": 1, "cpu_workers": 4}
    loader = AsyncLoader(
        DeepLakeSource(seg_url), **opts, transform=slow_while_flagged, processes=2, shutdown_timeout=1.0
    )
    it = iter(loader)
    assert index_lists([next(it), next(it)]) == EpochSampler(ROWS, 8).batches(0)[:2]
    pids = worker_pids()
    monkeypatch.delenv("ASYNCLOAD_TEST_STALL")
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 15  # 2 s to settle, then ask, SIGTERM, SIGKILL 1 s apart
    assert_gone(pids.values())
    assert "restarting the pool at the next epoch" in caplog.text
    got, fresh = epoch_of(loader, 0)
    assert index_lists(got) == EpochSampler(ROWS, 8).batches(0)
    assert set(fresh.values()).isdisjoint(pids.values())
    loader.close()
    assert_gone(fresh.values())
