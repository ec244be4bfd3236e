"""The node block store shared by many processes of one node, against a real S3 server (SeaweedFS): ranks
and their DataLoader workers fetch each row once for the whole node, the limit holds for the node (not per
process), and a process forked while a claim is held leaves nobody waiting for it.

Each rank is a process of its own with its rank and world size given (how it got them is
``test_clients``'s subject); every request that reaches the store is logged by ``RecordingSource``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from asyncload.nodestore import NodeStore

from .sources import RecordingSource

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("process_storms")]

ROOT = Path(__file__).resolve().parents[1]
OPTS = {"shuffle": True, "shuffle_block": 8, "shuffle_window": 32, "batch_size": 8, "seed": 4}

RANK = """
import json, sys
sys.path.insert(0, {root!r})
from torch.utils.data import DataLoader
from asyncload import AsyncIterableDataset, AsyncLoader
from tests.sources import RecordingSource
rank, world, workers, epochs = {rank}, {world}, {workers}, {epochs}
src = RecordingSource({url!r}, {log!r}, creds={creds!r})
out = []
if workers:  # (their forkserver imports torch and asyncload once, for every worker: as a user's script would)
    import multiprocessing
    multiprocessing.set_forkserver_preload(["torch", "asyncload", "tests.sources"])
    ds = AsyncIterableDataset(src, rank=rank, world_size=world, **{opts!r})
    for epoch in range(epochs):
        ds.set_epoch(epoch)
        dl = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="forkserver")
        out.append([int(i) for b in dl for i in b["index"]])
else:
    loader = AsyncLoader(src, rank=rank, world_size=world, **{opts!r})
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out.append([int(i) for b in loader for i in b["index"]])
    loader.close()
print(json.dumps(out))
"""


def run_ranks(
    data, log: Path, world: int, *, workers: int = 0, epochs: int = 2, nodes: Path | None = None, **opts
) -> list[list[list[int]]]:
    """``world`` rank processes started together; each one's rows per epoch. ``nodes``: a folder where
    simulated nodes of 2 ranks each keep their stores (``nodes/<n>``), their ranks given the variables
    torchrun gives them."""

    def env(r: int) -> dict[str, str]:
        if nodes is None:
            return dict(os.environ)
        return os.environ | {
            "ASYNCLOAD_CACHE_DIR": str(nodes / str(r // 2)), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(r // 2), "RANK": str(r), "LOCAL_RANK": str(r % 2),
        }  # fmt: skip

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK.format(
                    root=str(ROOT),
                    rank=r,
                    world=world,
                    workers=workers,
                    epochs=epochs,
                    url=data.deeplake_url,
                    log=str(log),
                    creds=data.creds(),
                    opts={**OPTS, **opts},
                ),
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env(r),
        )
        for r in range(world)
    ]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def every_row_once_per_epoch(outs: list[list[list[int]]], rows: int, epochs: int) -> None:
    for e in range(epochs):
        seen = Counter(i for rank in outs for i in rank[e])
        assert set(seen) == set(range(rows)), e


def test_four_ranks_over_two_epochs_fetch_each_row_once(remote_data, tmp_path) -> None:
    log = tmp_path / "reads.jsonl"
    outs = run_ranks(remote_data, log, 4, epochs=2)
    every_row_once_per_epoch(outs, remote_data.rows, 2)
    fetched = Counter(i for r in RecordingSource(remote_data.deeplake_url, log).reads for i in r)
    assert fetched == Counter(range(remote_data.rows))  # one fetch per row for the node, over both epochs


def test_two_simulated_nodes_fetch_each_row_once_for_the_cluster(remote_data, tmp_path) -> None:
    """2 nodes × 2 ranks (a node store each, torchrun's variables): with node-stable epochs (the default)
    each node keeps its part, so over 2 epochs every row is fetched once for the whole cluster; a global
    shuffle fetches rows again on the other node."""
    log = tmp_path / "reads.jsonl"
    outs = run_ranks(remote_data, log, 4, epochs=2, nodes=tmp_path / "nodes")
    every_row_once_per_epoch(outs, remote_data.rows, 2)
    fetched = Counter(i for r in RecordingSource(remote_data.deeplake_url, log).reads for i in r)
    assert fetched == Counter(range(remote_data.rows))
    for node in (0, 1):  # a node's ranks read the same rows every epoch
        ranks = outs[2 * node : 2 * node + 2]
        assert {i for r in ranks for i in r[0]} == {i for r in ranks for i in r[1]}
    glog = tmp_path / "global.jsonl"
    run_ranks(remote_data, glog, 4, epochs=2, nodes=tmp_path / "global", shuffle_scope="global")
    again = Counter(i for r in RecordingSource(remote_data.deeplake_url, glog).reads for i in r)
    assert sum(again.values()) > 1.2 * remote_data.rows  # each node fetches much of the other's part too


def disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def test_two_ranks_of_four_workers_keep_the_node_within_its_limit(remote_data, tmp_path) -> None:
    root = Path(os.environ["ASYNCLOAD_CACHE_DIR"])
    probe = run_ranks(remote_data, tmp_path / "probe.jsonl", 1, epochs=1, cache_dir=str(tmp_path / "whole"))
    every_row_once_per_epoch(probe, remote_data.rows, 1)
    probe_store = NodeStore(tmp_path / "whole", None)
    whole, index = probe_store.used(), probe_store.index.disk_bytes()  # (the parts, and the index with its log)
    probe_store.close()
    limit = whole // 2 + index
    outs = run_ranks(remote_data, tmp_path / "reads.jsonl", 2, workers=4, epochs=1, cache_limit=limit)
    every_row_once_per_epoch(outs, remote_data.rows, 1)
    store = NodeStore(root, None)
    assert 0 < store.used() and store.on_disk() <= limit
    store.close()
    parts = sum(p.stat().st_size for p in root.glob("parts/*/*.rows"))
    assert parts <= limit
    index = sum(p.stat().st_size for p in root.glob("index.sqlite3*"))
    assert disk_bytes(root) - index <= limit, (disk_bytes(root), index, limit)  # the parts, and nothing else
    assert index <= 3 << 20  # the index and its log (cut back to 1 MiB): a fixed cost, ~1% of a 300 MB store


FORKED = """
import os, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from asyncload.nodestore import NodeStore
shelf = NodeStore(Path({dir!r}), None).shelf("test|v1", "test")
held = shelf.claim([0])
assert held is not None and shelf.claim([0]) is None  # (another fetch of the same process waits too)
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the child: the parent's claim is not its own; its own connection to the index works
    ok = shelf.claim([0]) is None
    mine = shelf.claim([5])
    ok = ok and mine is not None
    shelf.unclaim([5], mine)
    os.write(w, b"y" if ok else b"n")
    time.sleep(30)
    os._exit(0)
assert os.read(r, 1) == b"y"  # the child checked while the parent held the claim
print(pid, flush=True)
shelf.unclaim([0], held)
print("released", flush=True)
time.sleep(30)
"""


def test_a_process_forked_while_a_claim_is_held_leaves_nobody_waiting(tmp_path) -> None:
    root = tmp_path / "store"
    holder = subprocess.Popen(
        [sys.executable, "-c", FORKED.format(root=str(ROOT), dir=str(root))], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    try:
        child = int(holder.stdout.readline())
        assert holder.stdout.readline().strip() == "released"
        shelf = NodeStore(root, None).shelf("test|v1", "test")
        assert shelf is not None
        t0 = time.monotonic()
        assert shelf.claim([0]) is not None  # at once: the forked child, alive, holds nothing
        assert time.monotonic() - t0 < 1.0
    finally:
        for pid in (holder.pid, locals().get("child")):
            if pid:
                with contextlib_suppress():
                    os.kill(pid, 9)
        holder.wait(timeout=10)


def contextlib_suppress():
    import contextlib

    return contextlib.suppress(ProcessLookupError)
