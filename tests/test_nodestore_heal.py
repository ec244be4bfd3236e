"""The node store heals itself (``nodestore.store``, ``engine.blocks``): a corrupt part is fetched again on
every path, a corrupt index is set aside and rebuilt, part files no index row names are reclaimed at open
(a process killed mid-eviction), an evicted shelf receives no parts, and a closed loader leaves no file of
the store open."""

from __future__ import annotations

import logging
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource
from asyncload.nodestore import CorruptPart, NodeStore

from .conftest import ROWS, WORKER_START

pytestmark = pytest.mark.timeout(180)

OPTS = {"shuffle": True, "shuffle_block": 8, "shuffle_window": 32, "cache": True, "batch_size": 16}
ROOT = Path(__file__).resolve().parents[1]


def store_root() -> Path:
    return Path(os.environ["ASYNCLOAD_CACHE_DIR"])


def flip_largest(root: Path, parts: int = 3, nbytes: int = 16) -> int:
    """``nbytes`` flipped in the middle of a row of each of the ``parts`` largest part files (bit rot, a torn
    write; in a row the index names: a part may also hold bytes of rows another process kept first); how many
    parts were damaged."""
    largest = sorted(root.glob("parts/*/*.rows"), key=lambda p: p.stat().st_size)[-parts:]
    with sqlite3.connect(f"file:{root / 'index.sqlite3'}?mode=ro", uri=True) as db:
        for p in largest:
            found = db.execute("SELECT off, len FROM entries WHERE part = ? ORDER BY off", (int(p.stem),)).fetchall()
            off, n = found[len(found) // 2]
            data = bytearray(p.read_bytes())
            at = off + max(0, n // 2 - nbytes // 2)
            data[at : at + nbytes] = bytes(b ^ 0xFF for b in data[at : at + nbytes])
            p.write_bytes(bytes(data))
    return len(largest)


def check_exact(batches, images: np.ndarray, masks: np.ndarray, rows: int) -> None:
    seen: Counter[int] = Counter()
    for b in batches:
        for k, i in enumerate(b["index"].tolist()):
            seen[i] += 1
            assert np.array_equal(b["images"][k].numpy(), images[i]), i
            assert np.array_equal(b["masks"][k].numpy(), masks[i]), i
    assert seen == Counter(range(rows))


def test_corrupt_parts_of_a_remote_dataset_are_fetched_again_in_every_shuffled_epoch(remote_data) -> None:
    """The issue's case: a remote Deep Lake dataset on S3 one epoch into the store, 16 bytes flipped in the
    largest parts, then new shuffled epochs (read through the reader process). Before the fix a request
    whose rows lay in a part that a request beside it had just dropped failed with ``KeyError: <row>``."""
    src = DeepLakeSource(remote_data.deeplake_url, creds=remote_data.creds())
    first = AsyncLoader(src, batch_size=16, shuffle=True)
    list(first)
    first.close()
    for seed in (1, 2, 3):
        assert flip_largest(store_root()) == 3
        loader = AsyncLoader(src, batch_size=16, shuffle=True, seed=seed)
        try:
            check_exact(list(loader), remote_data.images, remote_data.masks, remote_data.rows)
            assert loader.stats()["node_corrupt"] >= 1
        finally:
            loader.close()


def test_corrupt_parts_are_fetched_again_by_dataloader_workers_and_row_reads(seg_url, seg_arrays) -> None:
    opts = {**OPTS, "cache_dir": str(store_root())}  # (the workers fork from a server started by an earlier test)
    ds = AsyncIterableDataset(DeepLakeSource(seg_url), **opts)
    list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START))
    assert flip_largest(store_root()) == 3
    ds.set_epoch(1)
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)
    check_exact(list(dl), seg_arrays["images"], seg_arrays["masks"], ROWS)
    flip_largest(store_root())
    loader = AsyncLoader(DeepLakeSource(seg_url), read_mode="row", **{**opts, "shuffle_block": 1})
    try:
        check_exact(list(loader), seg_arrays["images"], seg_arrays["masks"], ROWS)
        assert loader.stats()["node_corrupt"] >= 1
    finally:
        loader.close()


def test_a_corrupt_index_is_set_aside_and_rebuilt_and_the_run_after_reads_from_the_store(
    seg_url, seg_arrays, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="asyncload")
    root = store_root()
    loader = AsyncLoader(DeepLakeSource(seg_url), **OPTS)
    list(loader)
    loader.close()
    with open(root / "index.sqlite3", "r+b") as f:  # its header and first pages overwritten
        f.write(b"\x5a" * 8192)
    hits = []
    for _ in range(2):
        loader = AsyncLoader(DeepLakeSource(seg_url), **OPTS)
        check_exact(list(loader), seg_arrays["images"], seg_arrays["masks"], ROWS)
        hits.append(loader.stats()["node_hits"])
        loader.close()
    assert hits == [0, ROWS]  # the run that rebuilt it fetched every row; the next read them all from disk
    said = [r.getMessage() for r in caplog.records if "could not be used" in r.getMessage()]
    assert said == [
        f"asyncload: the node block store's index at {root / 'index.sqlite3'} could not be used (DatabaseError: "
        "file is not a database): moved aside to index.sqlite3.unreadable, its parts removed, and a new index "
        "started; the rows are fetched again"
    ]
    assert (root / "index.sqlite3.unreadable").exists()


EVICTOR = """
import os, sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
import asyncload.nodestore.parts as parts
from asyncload.nodestore import CorruptPart, NodeStore

unlink = parts.Parts.unlink

def slow_unlink(self, gone):  # the index has dropped the shelf: the parent kills this process now
    if gone:
        print("evicted", flush=True)
        time.sleep(30)
    unlink(self, gone)

parts.Parts.unlink = slow_unlink
store = NodeStore(Path({dir!r}), {limit})
shelf = store.shelf("new|v1", "new")
shelf.put(list(range(64)), {{"x@b": [bytes([i]) * 4000 for i in range(64)]}})
print("done", flush=True)
"""


def test_a_process_killed_mid_eviction_leaves_the_disk_within_the_limit_once_the_store_is_opened(tmp_path) -> None:
    root = tmp_path / "store"
    store = NodeStore(root, None)
    shelf = store.shelf("old|v1", "old")
    for k in range(4):
        assert shelf.put(list(range(64 * k, 64 * k + 64)), {"x@b": [bytes([k]) * 4000] * 64})
    limit = store.on_disk() + 64 * 4096 // 2  # room for half a part more: the next part evicts "old"
    store.close()
    code = EVICTOR.format(root=str(ROOT), dir=str(root), limit=limit)
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "evicted"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
    parts = lambda: sum(p.stat().st_blocks * 512 for p in root.glob("parts/*/*.rows"))  # noqa: E731
    assert parts() >= 4 * 256_000  # the old shelf's files, which no index row names any more
    store = NodeStore(root, None)  # (the next process to open it)
    assert parts() == store.used() == 0  # the dead reservation and the old files reclaimed
    assert store.on_disk() <= limit
    store.close()


def test_an_evicted_shelf_receives_no_parts(tmp_path) -> None:
    """A shelf evicted by another process between its ``shelves`` row and a write (the race of a shelf
    opened while another process evicts it): the write is not kept, and nothing of it stays on disk."""
    store = NodeStore(tmp_path / "store", None)
    shelf = store.shelf("a|v1", "a")
    with store.transaction() as db:
        store._evict_in(db, shelf.id)
    assert shelf.put([0, 1], {"x@b": [b"a" * 100, b"b" * 100]}) is False
    assert store.used() == 0 and not list((tmp_path / "store").glob("parts/*/*.rows"))
    again = NodeStore(tmp_path / "store", None).shelf("a|v1", "a")  # opened anew: a new shelf, kept
    assert again is not None and again.id != shelf.id and again.put([0], {"x@b": [b"a"]})
    store.close()
    again.store.close()


def test_a_closed_loader_leaves_no_file_of_the_store_open_and_no_in_use_file(seg_url) -> None:
    def held() -> list[str]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                out.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                pass
        return [p for p in out if p.startswith(str(store_root()))]

    for _ in range(3):
        loader = AsyncLoader(DeepLakeSource(seg_url), **OPTS)
        list(loader)
        assert held()  # (while it is open: the root, the index, its log)
        loader.close()
        assert held() == []
    assert os.listdir(store_root() / "in-use") == []
    with sqlite3.connect(store_root() / "index.sqlite3") as db:
        assert db.execute("SELECT COUNT(*) FROM shelves").fetchone()[0] == 1


def test_parts_deleted_by_hand_are_forgotten_at_open_and_their_room_given_back(tmp_path) -> None:
    root = tmp_path / "store"
    store = NodeStore(root, None)
    shelf = store.shelf("a|v1", "a")
    for k in range(3):
        assert shelf.put(list(range(64 * k, 64 * k + 64)), {"x@b": [bytes([k]) * 1000] * 64})
    one = store.used() // 3
    store.close()
    next(root.glob("parts/*/2.rows")).unlink()  # (a scratch cleaner, a user's rm)
    store = NodeStore(root, None)
    shelf = store.shelf("a|v1", "a")
    assert store.used() == 2 * one
    assert sorted(shelf.lookup(range(192), ["x@b"])) == [*range(64), *range(128, 192)]
    store.close()


def test_an_index_found_damaged_in_use_is_checked_and_rebuilt_at_the_next_open(seg_url, seg_arrays, caplog) -> None:
    """Damage past the header (a page of entries): connecting works, the first look-up fails. That process
    reads through (said once) and leaves a flag; the next open checks every page and rebuilds."""
    caplog.set_level(logging.WARNING, logger="asyncload")
    root = store_root()
    loader = AsyncLoader(DeepLakeSource(seg_url), **OPTS)
    list(loader)
    loader.close()
    size = (root / "index.sqlite3").stat().st_size
    assert size >= 8 * 4096
    with open(root / "index.sqlite3", "r+b") as f:  # the last pages: the entries' b-tree
        f.seek(size - 2 * 4096)
        f.write(bytes(range(256)) * (2 * 4096 // 256))
    hits = []
    for _ in range(3):
        loader = AsyncLoader(DeepLakeSource(seg_url), **OPTS)
        check_exact(list(loader), seg_arrays["images"], seg_arrays["masks"], ROWS)
        hits.append(loader.stats()["node_hits"])
        loader.close()
    assert hits == [0, 0, ROWS]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert said[0].startswith(f"asyncload: the node block store's index at {root / 'index.sqlite3'} is damaged (")
    assert said[0].endswith("the next process to open it checks it and starts a new one")
    assert "could not be used" in said[1] and "a new index started" in said[1]
    assert not (root / "index.damaged").exists()


CHURN = """
import sys
sys.path.insert(0, {root!r})
from pathlib import Path
from asyncload.nodestore import CorruptPart, NodeStore
store = NodeStore(Path({dir!r}), {limit})
print("ready", flush=True)
k = {start}
while True:  # a new dataset version every two parts: past the limit each write evicts the oldest
    shelf = store.shelf(f"v{{k}}|1", "v")
    for j in range(2):
        shelf.put(list(range(64 * j, 64 * j + 64)), {{"x@b": [bytes([k % 256]) * 3000] * 64}})
    shelf.release()
    k += 1
"""


def test_kill_9_at_random_moments_of_evictions_leaves_the_disk_within_the_limit(tmp_path) -> None:
    rng = random.Random(58)
    root = tmp_path / "store"
    store = NodeStore(root, None)
    limit = store.on_disk() + 6 * store.alloc(64 * 3000)  # (six parts)
    store.close()
    for i in range(6):
        code = CHURN.format(root=str(ROOT), dir=str(root), limit=limit, start=1000 * i)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.05, 0.4))
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
        store = NodeStore(root, None)  # the next process to open it
        on_disk = sum(p.stat().st_blocks * 512 for p in root.glob("parts/*/*.rows"))
        assert 0 < on_disk <= store.used() and store.on_disk() <= limit, (i, on_disk, store.used(), limit)
        store.close()


def test_a_shelf_used_after_its_store_closed_reads_nothing_and_writes_nothing(tmp_path) -> None:
    """A read of an epoch abandoned as its loader closed the store: the shelf is off, a read of a part is a
    miss (``CorruptPart``: the rows go to the source), a write is not kept, and no descriptor number the
    store held (which the process may have reused) is written through."""
    store = NodeStore(tmp_path / "store", None)
    shelf = store.shelf("a|v1", "a")
    assert shelf.put([0, 1], {"x@b": [b"a", b"b"]})
    entries = [e["x@b"] for e in shelf.lookup([0, 1], ["x@b"]).values()]
    store.close()
    reused = [os.open(tmp_path, os.O_RDONLY) for _ in range(4)]  # (the numbers the store's descriptors had)
    try:
        assert shelf.off and store.full(shelf.id)
        assert shelf.lookup([0, 1], ["x@b"]) == {}
        with pytest.raises(CorruptPart):
            shelf.get(entries)
        assert shelf.put([2], {"x@b": [b"c"]}) is False
        assert shelf.claim([0]) is not None
        shelf.forget(entries[0].part)
    finally:
        for fd in reused:
            os.close(fd)
    assert sorted(os.listdir(tmp_path)) == ["store"]
