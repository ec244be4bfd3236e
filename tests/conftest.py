"""Shared fixtures: real Deep Lake datasets written by the project's own synthetic maker."""

from __future__ import annotations

import multiprocessing
import threading
import time
from pathlib import Path

import deeplake
import numpy as np
import pytest

from asyncload import EpochSampler, LoaderOptions, Shard, make_dataset
from asyncload.sources.deeplake import BLOCK_ROWS

# The servers' fixtures, registered here once for every module (each still starts only when a test asks
# for it). Imported into a test module instead, a session fixture is that module's own: each module that
# imported ``seaweed`` started a SeaweedFS server and wrote ``remote_data`` again, and kept both to the end
# of the session (42 servers in one pass).
from .remote_fixtures import (  # noqa: F401 - fixtures
    aws_files,
    azure_data,
    azurite,
    gcs_data,
    gcs_emulator,
    remote_data,
    running_seaweed,
    seaweed,
)

ROWS = 203  # prime-ish: exercises short last batches and uneven shards

# How the suite's DataLoader workers start where the start method is not what a test is about: forked
# from multiprocessing's forkserver, which imports torch once per pytest process. A spawned worker imports
# torch itself, ~2 CPU-seconds each, and the suite starts over a hundred of them. Each worker still
# imports asyncload and Deep Lake on its own, as a spawned one does (the server never imports Deep Lake:
# a process forked after that import is not safe). Spawn is tested where it is the subject (test_torch,
# test_clients) and fork where it is allowed.
WORKER_START = "forkserver"
multiprocessing.set_forkserver_preload(["torch"])


def shuffled(rows: int, batch_size: int, seed: int, block: int = BLOCK_ROWS) -> EpochSampler:
    """The plan a loader cuts with ``shuffle=True`` and the default shuffle settings, for a source whose
    ``block_rows`` is ``block`` (Deep Lake's by default; 1 for an object store: a full shuffle). The
    suite's datasets are small enough for ``LoaderOptions.sampler``'s one-mix rule: a full shuffle."""
    return LoaderOptions(shuffle=True, seed=seed, batch_size=batch_size).sampler(rows, Shard(), block)


HEIGHT, WIDTH = 40, 56  # not square, so a swapped axis shows


@pytest.fixture(scope="session")
def seg_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 203-row PNG segmentation dataset on local disk (read-only for tests)."""
    path = tmp_path_factory.mktemp("data") / "seg"
    return make_dataset(str(path), ROWS, height=HEIGHT, width=WIDTH, progress=False)


@pytest.fixture(scope="session")
def seg_arrays(seg_url: str) -> dict[str, np.ndarray]:
    """The whole dataset read synchronously, to compare loader output against."""
    ds = deeplake.open_read_only(seg_url)
    return {c: np.stack([np.array(ds[i][c]) for i in range(len(ds))]) for c in ("images", "masks")}


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test():
    """Fail the test that leaves a process of its own running once it and its fixtures are done (its
    loaders dropped and collected), instead of every later test in that pytest worker that counts the
    processes: a reader leaked once showed as nineteen failures elsewhere, and none where it leaked."""
    before = {p.pid for p in multiprocessing.active_children()}
    yield
    if all(p.pid in before for p in multiprocessing.active_children()):
        return  # (most tests: no garbage collection needed to know)
    deadline = time.monotonic() + 15  # a reader stopped by its loader's collection is joined well within it
    while left := [p for p in live_children() if p.pid not in before]:
        if time.monotonic() > deadline:
            pytest.fail(f"processes this test started are still running after it: {left}", pytrace=False)
        time.sleep(0.05)


def loop_threads() -> list[threading.Thread]:
    """An epoch's threads (its loop, its CPU pool). Not a Deep Lake reader process's receiver thread,
    which lives with the reader, across epochs, until the loader is closed (``reader_threads``)."""
    return [t for t in threading.enumerate() if t.name.startswith("asyncload") and t not in reader_threads()]


def live_children() -> list:
    """Child processes still alive once garbage is collected: a loader dropped in a reference cycle by an
    earlier test stops its reader only when the cycle is collected."""
    import gc
    import multiprocessing

    gc.collect()
    return multiprocessing.active_children()


def reader_threads() -> list[threading.Thread]:
    """A reader's threads, which live with it across epochs: its receiver, and where this process started the
    node's shared reader (``nodereader``), the thread that reaps it once its last loader, here or elsewhere, left."""
    names = ("asyncload-reader-receive", "asyncload-node-reader-reap")
    return [t for t in threading.enumerate() if t.name in names]


def child_pids(parent: int | None = None) -> list[int]:
    """The children of ``parent`` (this process by default) as the kernel lists them, zombies included.
    Reads ``/proc`` and reaps nothing, so any thread may call it while the loader reaps its own."""
    import glob
    import os

    pids: list[int] = []
    for path in glob.glob(f"/proc/{os.getpid() if parent is None else parent}/task/*/children"):
        try:
            with open(path) as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:  # the thread (or the process) has ended
            continue
    return pids


def _proc(pid: int, what: str) -> str:
    try:
        with open(f"/proc/{pid}/{what}", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def zombies() -> list[int]:
    """Children of this process that ended and were never joined: a process the loader lost track of."""
    return [pid for pid in child_pids() if _proc(pid, "stat").rpartition(")")[2].split()[:1] == ["Z"]]


def reader_pids() -> list[int]:
    """The live reader processes (``IsolatedSource``): children of this process started by
    ``multiprocessing``'s spawn, as their command line says (a fan-out worker is a child of the forkserver)."""
    return [pid for pid in child_pids() if "spawn_main" in _proc(pid, "cmdline")]


def forked_workers() -> list[int]:
    """The children of this process's multiprocessing forkserver: the fan-out workers of
    ``mp_context="forkserver"`` (the default), alive or not yet reaped by the server."""
    servers = [pid for pid in child_pids() if "multiprocessing.forkserver" in _proc(pid, "cmdline")]
    return [pid for server in servers for pid in child_pids(server)]


def worker_pids() -> dict[int, int]:
    """Worker index → pid of the live fan-out workers, by the names they are started with
    (``asyncload-fanout-<k>``) in ``multiprocessing``'s table of children. That table is read by polling
    the children, so call it where no other thread of the test joins them (not inside ``next()``)."""
    import multiprocessing

    prefix = "asyncload-fanout-"
    return {
        int(p.name.removeprefix(prefix)): p.pid for p in multiprocessing.active_children() if p.name.startswith(prefix)
    }


def no_children_left() -> bool:
    """Every process a loader started here has ended and been joined: none a zombie (``/proc``), none
    alive (``multiprocessing``'s table; after garbage collection, as ``live_children``)."""
    return not zombies() and not live_children()


def pids_gone(pids) -> bool:
    """Whether none of ``pids`` is a live process any more."""
    import os

    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


def wait_no_loop_threads(deadline_s: float = 5.0) -> None:
    """Poll until no asyncload thread is alive; fail with their names after the deadline."""
    end = time.monotonic() + deadline_s
    while loop_threads() and time.monotonic() < end:
        time.sleep(0.02)
    assert not loop_threads(), f"threads left behind: {[t.name for t in loop_threads()]}"


@pytest.fixture
def copy_of(tmp_path: Path, seg_url: str):
    """A writable copy of the test dataset (for tests that damage it)."""
    import shutil

    def make() -> Path:
        dst = tmp_path / "copy"
        shutil.copytree(seg_url.removeprefix("file://"), dst)
        return dst

    return make


@pytest.fixture(autouse=True)
def _node_store_of_this_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's node block store (``nodestore``) in its own directory, for the processes it
    starts too: a test never reads what another one kept."""
    monkeypatch.setenv("ASYNCLOAD_CACHE_DIR", str(tmp_path / "node-store"))


@pytest.fixture(autouse=True)
def _no_failing_deep_lake_read_in_this_process(monkeypatch: pytest.MonkeyPatch):
    """Deep Lake 4.7.4 segfaults now and then while delivering a failed read, so a test whose Deep Lake
    read fails in the pytest process could kill the whole run: such reads belong in a reader process (the
    default) or a subprocess. ``DeepLakeSource.read`` is wrapped here, in this process only (a reader or
    worker process imports the class afresh), to count the reads that fail with ``ReadError``."""
    from asyncload.errors import ReadError
    from asyncload.sources.deeplake import DeepLakeSource

    original = DeepLakeSource.read
    failed: list[list[int]] = []

    async def read(self: DeepLakeSource, indices: list[int], raw: frozenset[str] = frozenset()):  # noqa: ANN202
        try:
            return await original(self, indices, raw)
        except ReadError as exc:
            failed.append(list(exc.indices))
            raise

    monkeypatch.setattr(DeepLakeSource, "read", read)
    yield
    assert not failed, (
        f"{len(failed)} Deep Lake read(s) failed inside the pytest process: read failing datasets through the "
        "default reader process (not processes=0) or in a subprocess"
    )


#: xdist groups that start first, in this order: the longest single runs (the operator's offline install and
#: ``make gpu-check``, 3-7 minutes; the process storms, one after another on one worker) overlap the rest of
#: the suite instead of ending it alone. ``loadgroup`` hands out work in collection order.
FIRST_GROUPS = ("operator", "process_storms")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        marker = item.get_closest_marker("xdist_group")
        group = (marker.args[0] if marker.args else marker.kwargs.get("name")) if marker else None
        return FIRST_GROUPS.index(group) if group in FIRST_GROUPS else len(FIRST_GROUPS)

    items.sort(key=rank)  # stable: within a rank, collection order
