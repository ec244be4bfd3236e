"""The node's shared Deep Lake reader (``processes.nodereader``, issue 61): the loaders of one node (one node
store) read through one reader process, so that Deep Lake's pages are fetched once per node; it admits only
this user's processes that hold the user's key; its death costs each loader a restart and nothing else; and
it ends with its last loader. The wire bytes of one node's ranks are counted at a real S3 server's port."""

from __future__ import annotations

import json
import logging
import os
import pickle
import signal
import socket
import struct
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from asyncload import AsyncLoader, DeepLakeSource
from asyncload.processes.nodereader import (
    Launch,
    _connect,
    connect,
    handshake,
    held,
    lock_name,
    readers_dir,
    socket_name,
)

from .conftest import ROWS, pids_gone, reader_pids
from .sources import CrashingSource, HandleLog

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


def _indices(batches) -> list[int]:
    return [int(i) for b in batches for i in b["index"]]


def _gone_soon(pids: list[int], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not pids_gone(pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_the_loaders_of_one_node_read_through_one_reader_that_ends_with_the_last(seg_url, tmp_path) -> None:
    opts = {"shuffle": True, "seed": 2, "cache": True, "cache_dir": str(tmp_path / "node")}
    a = AsyncLoader(DeepLakeSource(seg_url), 8, rank=0, world_size=2, **opts)
    b = AsyncLoader(DeepLakeSource(seg_url), 8, rank=1, world_size=2, **opts)
    got = _indices(a) + _indices(b)
    pid = a._isolated.pid
    assert pid is not None and b._isolated.pid == pid  # one reader for both
    assert "asyncload.processes.nodeserver import server_main" in _cmdline(pid) and pid not in reader_pids()
    assert set(got) == set(range(ROWS)) and len(got) == ROWS + ROWS % 2  # (an odd last row padded: ``remainder``)
    readers = tmp_path / "node" / "readers"
    assert (readers.stat().st_mode & 0o777) == 0o700 and (readers / socket_name()).is_socket()
    a.close()
    time.sleep(0.3)
    assert not pids_gone([pid])  # it serves b still
    assert set(_indices(b) + _indices(a)) == set(range(ROWS))  # a closed loader joins it again
    a.close()
    b.close()
    assert _gone_soon([pid]) and not (readers / socket_name()).exists()
    off = AsyncLoader(DeepLakeSource(seg_url), 8, shared_reader=False, **opts)
    assert off._isolated.pid in reader_pids()  # a reader of its own
    off.close()


def test_a_handle_of_the_shared_reader_is_closed_once_its_last_loader_has_left(seg_url, tmp_path) -> None:
    """A loader kept for the job keeps the node's reader up while others come and go (a validation loader made
    each epoch): each of their handles is closed once its loader has left, not kept to the reader's exit."""
    log = tmp_path / "handles.log"
    opts = {"shuffle": True, "seed": 1, "cache": True, "cache_dir": str(tmp_path / "node")}
    train = AsyncLoader(HandleLog(seg_url, log), 8, **opts)
    assert sorted(_indices(train)) == list(range(ROWS))
    server = train._isolated.pid
    seen = HandleLog(seg_url, log)
    for epoch in range(3):
        val = AsyncLoader(HandleLog(seg_url, log, columns=("images",)), 8, **opts)  # another source: its own handle
        assert sorted(_indices(val)) == list(range(ROWS)) and val._isolated.pid == server
        val.close()
        deadline = time.monotonic() + 10
        while seen.count("close", server) <= epoch and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen.count("close", server) == epoch + 1, log.read_text()
    assert seen.count("open", server) == 4  # train's, then each validation loader's
    assert sorted(_indices(train)) == list(range(ROWS))  # train's own handle is untouched
    assert not pids_gone([server])
    train.close()
    assert _gone_soon([server]) and seen.count("close", server) == 4, log.read_text()


def test_a_crash_of_the_shared_reader_costs_each_loader_a_restart_and_loses_nothing(seg_url, tmp_path, caplog) -> None:
    crash = {17}
    opts = {"shuffle": True, "seed": 5, "shuffle_block": 1, "concurrency": 4, "cache": True,
            "cache_dir": str(tmp_path / "node")}  # fmt: skip
    expected = [
        _indices(AsyncLoader(DeepLakeSource(seg_url), 8, rank=r, world_size=2, processes=0, shuffle=True, seed=5,
                             shuffle_block=1))
        for r in (0, 1)
    ]  # fmt: skip
    loaders = [
        AsyncLoader(CrashingSource(seg_url, crash, sig=signal.SIGSEGV, once_dir=str(tmp_path)), 8, rank=r,
                    world_size=2, **opts)
        for r in (0, 1)
    ]  # fmt: skip
    shared = loaders[0]._isolated.pid
    assert loaders[1]._isolated.pid == shared
    with caplog.at_level(logging.WARNING, logger="asyncload"):
        its = [iter(lo) for lo in loaders]
        got: list[list[int]] = [[], []]
        live = [0, 1]
        while live:  # both loaders' reads in flight together, through the one reader
            for r in list(live):
                try:
                    got[r] += [int(i) for i in next(its[r])["index"]]
                except StopIteration:
                    live.remove(r)
    assert got == expected  # every row once, in the order one process gives, on both loaders
    restarts = [lo.stats()["worker_restarts"] for lo in loaders]
    assert all(n >= 1 for n in restarts) and sum(restarts) <= 3, restarts
    words = [r.getMessage() for r in caplog.records if "node's shared reader process" in r.getMessage()]
    assert words and all(f"pid {shared}" in m for m in words), words
    own = [lo._isolated.pid for lo in loaders]
    assert shared not in own and len(set(own)) == 2 and set(own) <= set(reader_pids())  # each its own now
    for lo in loaders:
        lo.close()
    assert _gone_soon([shared, *own])


def test_the_shared_reader_admits_only_a_holder_of_the_users_key(tmp_path) -> None:
    root = tmp_path / "node"
    conn, node = connect(root)
    readers = os.open(root / "readers", os.O_RDONLY | os.O_DIRECTORY)
    address = f"/proc/self/fd/{readers}/{socket_name()}"
    try:
        with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
            Client(address, family="AF_UNIX", authkey=os.urandom(32))
        # A process without the key that skips the challenge and sends a pickle that would run code there:
        marker = tmp_path / "ran"

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {marker}",))

        evil = pickle.dumps(Evil())
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(10)
            s.connect(address)
            s.sendall(struct.pack("!i", len(evil)) + evil)
            while s.recv(4096):  # the server's challenge; then it hangs up on the wrong answer
                pass
        time.sleep(0.5)
        assert not marker.exists()
        again, node2 = connect(root)  # and it still serves this user's loaders
        assert node2.pid == node.pid
        again.close()
        node2.leave()
    finally:
        os.close(readers)
        conn.close()
        node.leave()
    assert _gone_soon([node.pid])


def test_a_loader_that_connects_as_the_last_one_leaves_is_served_not_reset(tmp_path) -> None:
    """The server stops only under the node's start lock, after a last look for a loader queued on its socket;
    a loader connects under that lock (``launch``). So a loader that connects as the last one leaves is served
    by that server, and served while it still holds the lock: the server only tries the lock (a loader that
    holds it may be waiting for the server's accept). Before, the server closed its listener with the loader
    queued: reset in its handshake, it read in a process of its own (seen in CI as an extra warning)."""
    root = tmp_path / "node"
    conn, node = connect(root)
    readers = readers_dir(root)
    try:
        with held(readers, lock_name()):  # as a loader in ``launch`` holds it
            conn.close()  # the last loader leaves: the server, idle, would stop now
            node.leave()
            time.sleep(0.5)
            sock = _connect(readers)
            assert sock is not None, "the server stopped listening without the start lock"
            # and it serves while the lock is held: it never waits for the lock (a loader holding it may be
            # waiting for the server's accept)
            again, node2 = handshake(Launch(sock, None))
        assert node2.pid == node.pid
        again.close()
        node2.leave()
    finally:
        os.close(readers)
    assert _gone_soon([node.pid]) and not (root / "readers" / socket_name()).exists()


def test_a_server_whose_directory_was_removed_stops_cleanly_when_its_last_loader_leaves(tmp_path) -> None:
    """A job that removes its cache directory while the node's reader still runs (a benchmark's cold store, a
    test's temporary directory): the server can no longer make its start lock there, and no loader can find
    its socket, so it stops all the same, with exit code 0. Before, its last look for a queued loader raised
    ``FileNotFoundError`` and it ended on a traceback (exit code 1)."""
    import shutil

    root = tmp_path / "node"
    conn, node = connect(root)
    assert node.popen is not None  # started here: its exit code can be read
    shutil.rmtree(root)
    conn.close()
    node.leave()
    assert node.popen.wait(timeout=30) == 0


@pytest.mark.xdist_group("process_storms")
@pytest.mark.timeout(420)
def test_four_ranks_of_one_node_pull_deep_lakes_pages_once(seaweed, tmp_path) -> None:
    """4 ranks × 2 epochs on one node, a node store and one endpoint, as in a real job: what the S3 server's
    port sees is within 5% of one process's single epoch, and no page is fetched twice; each rank with a
    reader of its own (``shared_reader=False``, the control) fetches pages again."""
    from benchmarks.suites.per_process_reads import build, run, summary
    from harness.s3log import RequestLog

    seaweed.create_bucket("noderead")
    url = build(seaweed, "noderead", "s66", 1024, 66, "sample")
    options = {"shuffle_window": 4096, "shuffle_block": "auto"}
    totals, again = {}, {}
    with RequestLog(("127.0.0.1", seaweed.port), ["r0"]) as proxy:
        for name, world, epochs, opts in [("solo", 1, 1, options), ("shared", 4, 2, options),
                                          ("own", 4, 2, {**options, "shared_reader": False})]:  # fmt: skip
            proxy.clear()
            outs = run(proxy, seaweed, url, world, epochs, opts, one_endpoint=True)
            for e in range(epochs):
                assert sorted(i for o in outs for i in o[e]["rows"]) == list(range(1024)), (name, e)
            got = summary(proxy.entries())
            totals[name] = got["total_bytes"]
            kinds = got["per_kind"]
            again[name] = kinds.get("pages again (same process)", 0) / kinds["pages"]
    assert totals["shared"] <= 1.05 * totals["solo"], totals
    assert again["shared"] == 0, again
    assert again["own"] > 0.05, again  # the control: without the shared reader, pages are fetched again


def test_a_source_the_shared_reader_cannot_take_is_refused_to_that_loader_alone(tmp_path) -> None:
    from asyncload.processes.isolated import _read_frame

    root = tmp_path / "node"
    conn, node = connect(root)
    other, node2 = connect(root)
    try:
        conn.send(("source", "no_such_module_of_asyncload", b"not a pickle", []))
        kind, _, why, _ = _read_frame(conn.fileno())
        assert kind == "refused" and "ModuleNotFoundError" in why and "no_such_module_of_asyncload" in why
        assert not pids_gone([node.pid]) and node2.pid == node.pid  # it goes on serving the node's loaders
    finally:
        for c, n in ((conn, node), (other, node2)):
            c.close()
            n.leave()
    assert _gone_soon([node.pid])


def _servers_of(cache: Path) -> list[int]:
    """The node's shared readers of the node store at ``cache``, wherever in the process tree they are."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                line = _cmdline(int(pid))
            except OSError:
                continue
            if "server_main" in line and str(cache) in line:
                found.append(int(pid))
    return found


@pytest.mark.xdist_group("process_storms")
def test_dataloader_workers_read_through_the_nodes_reader_and_a_crash_of_it_loses_nothing(seg_url, tmp_path) -> None:
    from torch.utils.data import DataLoader

    from asyncload import AsyncIterableDataset

    cache = tmp_path / "node"
    # One row that kills the first process that reads it: the node's reader (a second such row would be read
    # by the worker itself once the node's reader is gone, and end it: DataLoader's to report, as before).
    crash = CrashingSource(seg_url, {40}, sig=signal.SIGSEGV, once_dir=str(tmp_path))
    ds = AsyncIterableDataset(crash, batch_size=8, shuffle=True, seed=1, cache=True, cache_dir=str(cache))
    servers: set[int] = set()
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = []
        for b in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="forkserver"):
            got += [int(i) for i in b["index"]]
            servers |= set(_servers_of(cache))
        assert sorted(got) == list(range(ROWS)), (
            epoch
        )  # the crashes cost nothing, in workers that may not start children
    assert servers  # the workers read through the node's reader (a daemonic worker could not start one of its own)
    assert (tmp_path / "row-40").exists()  # and row 40 did kill it
    assert _gone_soon(_servers_of(cache))


def test_a_loader_whose_source_the_nodes_reader_refuses_reads_in_a_reader_of_its_own(seg_url, tmp_path, caplog) -> None:
    from .sources import NotForTheNodeReader

    with caplog.at_level(logging.WARNING, logger="asyncload"):
        with AsyncLoader(
            NotForTheNodeReader(seg_url), 8, shuffle=True, cache=True, cache_dir=str(tmp_path / "n")
        ) as lo:
            got = _indices(lo)
            own_reader = lo._isolated.pid in reader_pids()  # a child of this process's, spawned
            restarts = lo.stats()["worker_restarts"]
    assert sorted(got) == list(range(ROWS)) and restarts == 0  # nothing died, nothing was lost
    assert own_reader
    said = [r.getMessage() for r in caplog.records if "did not take" in r.getMessage()]
    assert len(said) == 1 and "not read by the node's reader" in said[0] and "a reader process of its own" in said[0]


def test_a_loader_never_reads_an_older_dataset_through_the_shared_reader(tmp_path) -> None:
    """A dataset made again at its URL while another loader of the node reads through the shared reader: the
    new loader's source is opened anew there (its ``store_key`` differs), never served the old handle."""
    import shutil

    import deeplake
    import numpy as np

    def make(url: str, value: int) -> None:
        ds = deeplake.create(url)
        ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="png"))
        ds.append({"images": list(np.full((16, 8, 8, 3), value, np.uint8))})
        ds.commit()

    path = tmp_path / "again"
    url = "file://" + str(path)
    make(url, 1)
    opts = {"cache": True, "cache_dir": str(tmp_path / "node"), "with_index": False}
    first = AsyncLoader(DeepLakeSource(url, columns=["images"]), 8, **opts)
    assert int(next(iter(first))["images"].max()) == 1
    shutil.rmtree(path)
    make(url, 9)  # the same URL, the same first commit id: only the dataset's id tells them apart
    second = AsyncLoader(DeepLakeSource(url, columns=["images"]), 8, **opts)
    assert second._isolated.pid == first._isolated.pid  # one node reader for both
    assert {int(b["images"].max()) for b in second} == {9}
    second.close()
    first.close()


TWO_BUILDS = """
import json, sys
import asyncload
from asyncload import AsyncLoader, DeepLakeSource
loader = AsyncLoader(DeepLakeSource(sys.argv[1]), 8, shuffle=True, seed=1, cache=True, cache_dir=sys.argv[2])
print(json.dumps({"server": loader._isolated.pid, "package": asyncload.__file__}), flush=True)
sys.stdin.readline()
print(json.dumps({"got": sorted(int(i) for b in loader for i in b["index"])}), flush=True)
loader.close()
"""


def test_two_builds_of_asyncload_on_one_node_each_read_through_a_server_of_their_own(seg_url, tmp_path) -> None:
    """A node where two jobs run two builds of asyncload (an upgrade while an older job reads; two checkouts):
    each loader meets only a server that runs its own code, started on that code whatever the working
    directory would import, and both epochs are exact. One server for both would unpickle one build's sources
    with the other's classes and send frames the other cannot read (it did: a stall of 120 s)."""
    import shutil
    import subprocess
    import sys

    other = tmp_path / "other"
    shutil.copytree(ROOT / "asyncload", other / "asyncload", ignore=shutil.ignore_patterns("__pycache__"))
    with open(other / "asyncload" / "processes" / "isolated.py", "a") as f:
        f.write("# another build\n")
    jobs = {}
    for name, cwd in (("this", ROOT), ("other", other)):
        argv = [sys.executable, "-c", TWO_BUILDS, seg_url, str(tmp_path / "node")]
        jobs[name] = subprocess.Popen(argv, cwd=cwd, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        said = {name: json.loads(job.stdout.readline() or "null") for name, job in jobs.items()}
        assert all(said.values()), {name: job.stderr.read()[-3000:] for name, job in jobs.items() if not said[name]}
        assert said["this"]["package"].startswith(str(ROOT)) and said["other"]["package"].startswith(str(other))
        servers = {name: s["server"] for name, s in said.items()}
        assert servers["this"] != servers["other"], servers
        lines = {name: _cmdline(pid) for name, pid in servers.items()}
        assert all("asyncload.processes.nodeserver import server_main" in line for line in lines.values()), lines
        assert str(other) in lines["other"] and str(other) not in lines["this"], lines
        assert len(list((tmp_path / "node" / "readers").glob("reader-*.sock"))) == 2
        for name, job in jobs.items():
            out, err = job.communicate("\n", timeout=120)
            assert job.returncode == 0, err[-3000:]
            assert json.loads(out.strip().splitlines()[-1])["got"] == list(range(ROWS)), name
    finally:
        for job in jobs.values():
            job.kill()
            job.wait(10)
    assert _gone_soon(list(servers.values()))
