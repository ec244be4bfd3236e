"""Deep Lake reads run in a reader process by default, and a reader that dies is replaced with nothing lost.

Crashes are real: ``CrashingSource`` kills its own reader process with a real signal on chosen rows (as
Deep Lake's failing-read bug does), and the reproducer test reads a real dataset whose image chunk is gone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asyncload import (
    AsyncIterableDataset,
    AsyncLoader,
    DeepLakeSource,
    ReaderCrashError,
    ReadError,
    StallError,
    WorkerError,
)
from asyncload.sources.subset import RangeSource

from .conftest import ROWS, no_children_left, pids_gone, reader_threads
from .sources import CrashingSource, ExpiringSource, FailingSource

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


def _indices(batches) -> list[int]:
    return [int(i) for b in batches for i in b["index"]]


def test_deep_lake_is_read_in_a_reader_process_by_default_and_other_sources_here(seg_url) -> None:
    earlier = set(reader_threads())  # an earlier test's loader, not yet collected, may still hold its reader
    with AsyncLoader(DeepLakeSource(seg_url), 16, shuffle=True) as loader:
        assert loader.processes == 1
        got = _indices(loader)
        reader = loader._isolated.pid
        assert loader._pool is None  # not the fan-out: only the reads cross, the batches are made here
        # The reader imports the source and Deep Lake, not torch (its start and memory are a fraction).
        assert "libtorch" not in Path(f"/proc/{reader}/maps").read_text()
        assert 0 < loader.stats()["reader_start_s"] < 30  # its start, in the figures
    assert sorted(got) == list(range(ROWS)) and reader not in (None, os.getpid()) and pids_gone([reader])
    assert not set(reader_threads()) - earlier  # closing the loader ended its reader's receiver thread too
    plain = AsyncLoader(DeepLakeSource(seg_url), 16, processes=0)  # the documented way out
    assert plain.processes == 0 and plain.stats()["reader_start_s"] is None
    assert AsyncLoader(RangeSource(DeepLakeSource(seg_url), 0, 10), 4, processes=3).processes == 3


TRAINING_SCRIPT = """
import json, sys
from asyncload import AsyncLoader, DeepLakeSource
src = DeepLakeSource(sys.argv[1], creds=json.loads(sys.argv[2]))
with AsyncLoader(src, 16, shuffle=True, seed=3) as loader:
    got, first = [], None
    for b in loader:
        got += [int(i) for i in b["index"]]
        first = first or (b["images"][0].numpy().tolist(), int(b["index"][0]))
imported = sorted(m for m in ("deeplake", "aiohttp", "yarl") if m in sys.modules)
print(json.dumps({"got": got, "imported": imported, "len": len(src), "version": src.version, "first": first}))
"""


def test_the_training_process_opens_a_dataset_in_a_bucket_without_deep_lake_or_an_http_client(remote_data) -> None:
    """With a reader process (the default), the training process probes the bucket with the standard
    library's client and takes the dataset's length, version and columns from the reader's open: it imports
    neither Deep Lake nor aiohttp, and opens nothing itself, and the epoch is every row once, each the row
    its index names."""
    import deeplake

    p = subprocess.run(
        [sys.executable, "-c", TRAINING_SCRIPT, remote_data.deeplake_url, json.dumps(remote_data.creds())],
        capture_output=True, text=True, timeout=150, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["imported"] == []
    assert sorted(out["got"]) == list(range(remote_data.rows)) and out["got"] != sorted(out["got"])
    assert out["len"] == remote_data.rows
    assert out["version"] == str(deeplake.open_read_only(remote_data.deeplake_url, creds=remote_data.creds()).version)
    pixels, row = out["first"]
    assert pixels == remote_data.images[row].tolist()


def test_a_reader_that_dies_opening_the_dataset_is_replaced_and_the_next_ones_open_answers(seg_url, tmp_path) -> None:
    """The training process does not open Deep Lake: it waits for the reader's open. A reader killed while it
    opens (before it said what it opened) is replaced as any dead reader is, the loader is built from the next
    one's open, and the epoch is exact."""
    from .sources import CrashingOpen

    src = CrashingOpen(seg_url, (), once_dir=str(tmp_path))
    with AsyncLoader(src, 16, shuffle=True, seed=5) as loader:
        assert (tmp_path / "open").exists()  # the first reader died in its open
        assert src._handle_obj is None and len(loader.source) == ROWS
        assert sorted(_indices(loader)) == list(range(ROWS))


@pytest.mark.timeout(60)
def test_a_description_that_cannot_be_sent_fails_the_loader_at_once_naming_why(seg_url) -> None:
    """What the reader's open said must reach the training process, which waits for it: where it cannot be
    pickled, the loader fails with the pickling error at once, not after the open's deadline (30 s and
    ``stall_timeout``), and its reader is stopped."""
    from .sources import UnsendableDescription

    began = time.monotonic()
    with pytest.raises(TypeError, match="pickle"):
        AsyncLoader(UnsendableDescription(seg_url), 16)
    assert time.monotonic() - began < 20


def test_a_reader_silent_at_its_open_is_stopped_at_the_opens_deadline_with_a_stall_error(seg_url, monkeypatch) -> None:
    """A reader whose open of the dataset never answers (its store silent) holds up the loader only for a
    start's allowance and ``stall_timeout``: then it is stopped, and a ``StallError`` names the dataset and
    the deadline. (The allowance, 30 s, is cut to 1 s here: it is the training process's own clock.)"""
    from asyncload.processes import isolated

    from .sources import SilentOpen

    monkeypatch.setattr(isolated, "_START_ALLOWANCE", 1.0)
    began = time.monotonic()
    with pytest.raises(StallError, match=r"did not open .*seg within 2 s \(a start's 1 s and stall_timeout=1\)"):
        AsyncLoader(SilentOpen(seg_url), 16, stall_timeout=1.0)
    assert 2.0 <= time.monotonic() - began < 15
    assert no_children_left()  # the silent reader was stopped, not left asleep


def test_a_split_of_deep_lake_is_read_in_a_reader_process_too_and_a_crash_there_loses_nothing(
    seg_url, tmp_path
) -> None:
    # What ``asyncload train`` reads: a row range of the dataset. Its reads must be isolated like the
    # dataset's own; the crash below would end this test's process if they were not.
    inner = CrashingSource(seg_url, {20, 33}, sig=signal.SIGSEGV, once_dir=str(tmp_path))
    split = RangeSource(inner, 16, 48)
    assert split.isolate_reads and split.opens_alike and split.reader_module == "tests.sources"
    copied = split.reader_copy()
    assert isinstance(copied, RangeSource) and copied.inner is not inner and copied.inner._checked
    assert (copied.start, copied.stop) == (16, 48) and not inner._checked
    with AsyncLoader(split, 8, shuffle=True, seed=1, concurrency=4) as loader:
        assert loader.processes == 1
        got = _indices(loader)
        assert loader.stats()["worker_restarts"] == 2
    assert sorted(got) == list(range(16, 48))  # the dataset's own row numbers, each once
    assert no_children_left()  # the dead readers joined, the last one stopped


@pytest.mark.parametrize("sig", [signal.SIGSEGV, signal.SIGFPE, signal.SIGKILL])
def test_a_reader_killed_mid_epoch_is_replaced_and_every_row_comes_once_in_order(
    seg_url, tmp_path, caplog, sig
) -> None:
    # shuffle_block=1: rows shuffled one by one, read a batch at a time (blocks of contiguous rows would put
    # both crashing rows in flight together: one restart)
    expected = _indices(AsyncLoader(DeepLakeSource(seg_url), 8, shuffle=True, seed=3, shuffle_block=1, processes=0))
    rows = {expected[40], expected[130]}  # two crashes, far apart (one batch in flight): two restarts
    src = CrashingSource(seg_url, rows, sig=sig, once_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="asyncload"):
        with AsyncLoader(src, 8, shuffle=True, seed=3, shuffle_block=1, concurrency=8) as loader:
            got = _indices(loader)
            stats = loader.stats()
    assert got == expected  # every row once, in the order one process gives
    assert stats["worker_restarts"] == 2 and stats["skipped"] == 0
    restarts = [r.getMessage() for r in caplog.records if "reads them again" in r.getMessage()]
    assert len(restarts) == 2, restarts
    assert all(f"killed by signal {sig.name}" in m for m in restarts)
    assert str(expected[40]) in restarts[0]  # the log names the rows the dead reader held
    assert no_children_left()


def test_out_of_order_two_readers_and_a_crash_still_give_every_row_once(seg_url, tmp_path) -> None:
    src = CrashingSource(seg_url, {5, 77, 150}, sig=signal.SIGSEGV, once_dir=str(tmp_path))
    with AsyncLoader(src, 8, shuffle=True, shuffle_block=1, processes=2, in_order=False, concurrency=8) as loader:
        got = _indices(loader)
        assert loader.stats()["worker_restarts"] == 3
    assert sorted(got) == list(range(ROWS))


def test_a_row_that_always_kills_its_reader_is_named_with_url_row_and_signal(seg_url) -> None:
    order = _indices(AsyncLoader(DeepLakeSource(seg_url), 8, shuffle=True, seed=1, processes=0))
    bad = order[50]
    src = CrashingSource(seg_url, {bad}, sig=signal.SIGSEGV)
    loader = AsyncLoader(src, 8, shuffle=True, seed=1)
    got: list[int] = []
    with pytest.raises(ReaderCrashError) as info:
        for b in loader:
            got += [int(i) for i in b["index"]]
    err = info.value
    assert err.indices == [bad] and err.signal == "SIGSEGV" and err.source == src.url
    assert f"row {bad} of {src.url} killed its reader process (SIGSEGV)" in str(err)
    assert got == order[:48]  # the batches before the bad row's batch, in order
    # the loader survives it: the next epoch (with the bad row still there) raises the same, named
    loader.set_epoch(1)
    with pytest.raises(ReaderCrashError, match=f"row {bad} of"):
        for _ in loader:
            pass
    loader.close()
    assert no_children_left() and loader._isolated.pid is None


def test_every_row_of_a_read_that_kills_its_reader_is_named_in_one_error(seg_url) -> None:
    """One policy with the fan-out (``recovery``): the read is narrowed by halves to every row that kills
    a reader alone, and the error names them all, not only the first found."""
    opts = {"shuffle": True, "seed": 1, "shuffle_block": 1}  # rows shuffled one by one, read per request
    order = _indices(AsyncLoader(DeepLakeSource(seg_url), 8, **opts, processes=0))
    bad = sorted([order[48], order[49]])  # one request of 2: each row kills two readers alone, 6 deaths in all
    src = CrashingSource(seg_url, set(bad), sig=signal.SIGKILL)
    loader = AsyncLoader(src, 8, **opts, read_mode="column", request_size=2, concurrency=8)
    with pytest.raises(ReaderCrashError) as info:
        for _ in loader:
            pass
    err = info.value
    assert err.indices == bad and err.signal == "SIGKILL"
    assert f"reading rows {bad} of {src.url} killed its reader process (SIGKILL)" in str(err)
    loader.close()
    assert no_children_left()


def test_skip_leaves_out_the_rows_that_kill_their_reader_counts_and_reports_them(seg_url) -> None:
    bad = {3, 4, 120}
    src = CrashingSource(seg_url, bad, sig=signal.SIGFPE)
    with AsyncLoader(src, 8, shuffle=True, on_error="skip") as loader:
        got = _indices(loader)
        stats = loader.stats()
    assert sorted(got) == sorted(set(range(ROWS)) - bad)
    assert stats["skipped"] == 3
    assert sorted(i for i, _ in stats["skipped_samples"]) == sorted(bad)
    assert all("killed its reader process (SIGFPE)" in why for _, why in stats["skipped_samples"])


def test_deaths_past_max_restarts_end_the_epoch_with_worker_error(seg_url, tmp_path) -> None:
    order = _indices(AsyncLoader(DeepLakeSource(seg_url), 8, processes=0))
    src = CrashingSource(seg_url, {order[20], order[180]}, sig=signal.SIGSEGV, once_dir=str(tmp_path))
    loader = AsyncLoader(src, 8, max_restarts=1, concurrency=8)
    with pytest.raises(WorkerError, match=r"reader process \(pid \d+\) for .* was killed by signal SIGSEGV holding reads "
                       r"of indices .*after 1 restarts this epoch \(max_restarts=1\)"):  # fmt: skip
        for _ in loader:
            pass
    assert loader._isolated.pid is None and no_children_left()


def test_a_reader_that_cannot_be_replaced_ends_the_epoch_naming_why(seg_url, tmp_path) -> None:
    """The access handed to a reader comes from this process at each start: when it fails there, the dead
    reader's reads end the epoch with that reason, and nothing waits for a reader that never comes."""
    src = ExpiringSource(seg_url, {100}, sig=signal.SIGKILL, once_dir=str(tmp_path))
    loader = AsyncLoader(src, 8, concurrency=8)
    with pytest.raises(WorkerError, match=r"killed by signal SIGKILL holding reads of indices .*; no reader could "
                       r"replace it: SourceError: cannot renew the credentials for file://"):  # fmt: skip
        for _ in loader:
            pass
    assert loader._isolated.pid is None and no_children_left()


def test_max_restarts_0_keeps_the_first_death_fatal(seg_url, tmp_path) -> None:
    src = CrashingSource(seg_url, {100}, sig=signal.SIGKILL, once_dir=str(tmp_path))
    with pytest.raises(WorkerError, match="killed by signal SIGKILL holding"):
        for _ in AsyncLoader(src, 8, max_restarts=0):
            pass


def test_resume_and_later_epochs_on_the_replaced_reader_are_exact(seg_url, tmp_path) -> None:
    src = CrashingSource(seg_url, {60}, sig=signal.SIGSEGV, once_dir=str(tmp_path))
    ref = AsyncLoader(DeepLakeSource(seg_url), 8, shuffle=True, processes=0)
    with AsyncLoader(src, 8, shuffle=True) as loader:
        first = loader._isolated.pid  # started with the loader
        it = iter(loader)
        taken = [int(i) for _ in range(12) for i in next(it)["index"]]  # past the crash at row 60's batch
        state = loader.state_dict()
        it.close()
        replaced = loader._isolated.pid
        loader.load_state_dict(state)
        rest = _indices(loader)
        assert taken + rest == _indices(ref)
        loader.set_epoch(1)
        ref.set_epoch(1)
        assert _indices(loader) == _indices(ref)
        assert loader._isolated.pid == replaced  # the same persistent reader, its caches kept
        assert replaced != first and pids_gone([first])  # one replacement, the dead reader joined


def test_the_adapter_without_workers_reads_through_a_reader_process(seg_url, tmp_path) -> None:
    src = CrashingSource(seg_url, {10}, sig=signal.SIGSEGV, once_dir=str(tmp_path))
    ds = AsyncIterableDataset(src, 8, shuffle=True)
    got = _indices(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0))
    assert sorted(got) == list(range(ROWS))
    assert ds._here is not None and ds._here.stats()["worker_restarts"] == 1


def test_in_a_dataloader_worker_the_worker_is_the_isolation_and_dataloader_reports_its_death(seg_url) -> None:
    """A DataLoader worker is daemonic and cannot start a reader: it reads itself, so a crash ends that
    worker, and DataLoader raises it in the training process, which lives on."""
    ds = AsyncIterableDataset(CrashingSource(seg_url, {30}, sig=signal.SIGSEGV), 8)
    # spawn, not the suite's forkserver: a forkserver worker is not this process's child, so DataLoader's
    # SIGCHLD handler never sees it die and the death shows only when ``timeout`` runs out
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context="spawn", timeout=60)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid\(s\) \d+\) exited unexpectedly"):
        for _ in dl:
            pass
    assert _indices(AsyncLoader(DeepLakeSource(seg_url), 8))  # this process is fine


REPRODUCER = r"""
import json, sys
from asyncload import AsyncLoadError, AsyncLoader, DeepLakeSource
errors = []
for epoch in range(int(sys.argv[2])):
    try:
        for _ in AsyncLoader(DeepLakeSource(sys.argv[1]), batch_size=8):
            pass
        errors.append(None)
    except AsyncLoadError as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
print(json.dumps(errors))
"""


def test_the_failing_read_reproducer_runs_ten_epochs_with_the_defaults_each_a_named_error(copy_of) -> None:
    """Deep Lake's failing-read segfault, through the real path: a dataset whose image chunk is gone, read
    with the default settings for ten epochs in a fresh process (no ``__main__`` guard, as a user writes it).
    In the training process the same killed about seven runs in ten (docs/deeplake_failing_read.py)."""
    path = copy_of()
    chunk = max(
        (p for p in path.rglob("*") if p.is_file() and "_deeplake_log" not in p.parts), key=lambda p: p.stat().st_size
    )
    chunk.unlink()
    p = subprocess.run(
        [sys.executable, "-c", REPRODUCER, f"file://{path}", "10"],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    errors = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(errors) == 10
    for e in errors:  # a plain read error, or a crash narrowed down to its row: always named, never a death
        assert e is not None and f"file://{path}" in e, e
        assert e.startswith(("ReadError", "ReaderCrashError", "WorkerError")), e


@pytest.mark.parametrize("told", [None, "2"])
def test_a_reader_process_starts_numpy_with_one_blas_thread_unless_the_environment_says(told, monkeypatch) -> None:
    """numpy's import starts one OpenBLAS thread per core, which spin while they wait: a reader, which does
    no linear algebra, gets one; a count the user set is kept. Without ``quiet_blas`` a child on a machine
    of several cores runs more."""
    from asyncload.runtime.procs import start_child

    from .numpy_child import count_threads

    if told is None:
        monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", told)

    def threads(quiet: bool) -> int:
        proc, conn = start_child("spawn", count_threads, (), name="blas-test", needs_main=False, quiet_blas=quiet)
        try:
            assert conn.poll(60), "the child sent nothing"
            return conn.recv()
        finally:
            proc.join(30)
            conn.close()

    assert threads(True) == int(told or 1)
    if told is None and len(os.sched_getaffinity(0)) > 1:
        assert threads(False) == len(os.sched_getaffinity(0))


def test_answers_cross_in_frames_with_stored_bytes_as_views_and_arrays_writable() -> None:
    """The reader's answer frames, over a real socket pair, bigger than its buffer: every sample arrives
    equal, stored bytes as read-only views, arrays writable (a transform may change them in place)."""
    import socket
    import threading

    import numpy as np

    from asyncload.engine.protocol import Failure
    from asyncload.processes.isolated import _read_frame, _write_frame

    rng = np.random.default_rng(0)
    blobs = [rng.bytes(n) for n in (0, 1, 20_000, 3_000_000)]
    labels = [np.arange(6, dtype=np.int64).reshape(2, 3), np.zeros((0,), np.uint8)]
    stacked = rng.integers(0, 255, (4, 64, 64), dtype=np.uint8)
    a, b = socket.socketpair()
    sent = [("done", 7, {"images": blobs, "labels": labels, "masks": stacked}, (1, 2)),
            ("failed", 8, Failure(KeyError("row 3")), (1, 2))]  # fmt: skip
    writer = threading.Thread(target=lambda: [_write_frame(a.fileno(), m) for m in sent])
    writer.start()
    kind, rid, payload, counts = _read_frame(b.fileno())
    assert (kind, rid, counts) == ("done", 7, (1, 2))
    assert [bytes(v) for v in payload["images"]] == blobs
    assert all(isinstance(v, memoryview) and v.readonly for v in payload["images"])
    for got, want in zip(payload["labels"], labels, strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want) and got.flags.writeable
    assert np.array_equal(payload["masks"], stacked) and payload["masks"].flags.writeable
    kind, rid, failure, _ = _read_frame(b.fileno())
    assert (kind, rid) == ("failed", 8) and isinstance(failure.exc, KeyError)
    writer.join(10)
    a.close()
    with pytest.raises(EOFError):  # the reader's death, as the receiver thread sees it
        _read_frame(b.fileno())
    b.close()


@pytest.mark.timeout(120)
def test_a_reader_that_dies_as_close_is_called_is_not_started_again_after_close(seg_url) -> None:
    """The reader dies, and ``close()`` takes the source's lock before the receiver thread, which saw the
    death, gets to replace it: no reader may be started after ``close()`` (the receiver used to start one,
    which lived until the interpreter exited). The order is forced: the source's lock is made re-entrant
    and held here while the reader is killed and reaped, and ``close()`` runs inside it."""
    import threading
    import time

    loader = AsyncLoader(DeepLakeSource(seg_url), 16)
    iso = loader._isolated
    iso._lock = threading.RLock()  # (idle: nobody holds the old one) so that close() can run while held here
    iso._timeout = 1.0  # close() joins the receiver thread, which waits for this lock: not for 10 s
    pid, receiver = iso.pid, iso._holder[0].thread
    assert pid is not None and receiver is not None

    def receiver_in() -> set[str]:
        frame, names = sys._current_frames().get(receiver.ident), set()
        while frame is not None:
            names.add(frame.f_code.co_name)
            frame = frame.f_back
        return names

    lock = iso._lock
    lock.acquire()
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while "_died" not in receiver_in() and time.monotonic() < deadline:
            if "_watch" in receiver_in():  # its tick came first: let that pass, then it meets the EOF
                lock.release()
                time.sleep(0.001)
                lock.acquire()
            time.sleep(0.01)
        assert "_died" in receiver_in(), receiver_in()  # it saw the death, and waits to replace the reader
        iso.close()  # close() first, then the receiver handles the death
    finally:
        lock.release()
    deadline = time.monotonic() + 5
    while reader_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    started = iso.pid
    loader.close()  # (stops a reader started after close(), if the bug is back, before asserting)
    assert started is None, "a reader was started after close()"
    assert no_children_left() and not reader_threads()
    # A read after close() still starts a reader, as documented.
    assert sorted(_indices(loader)) == list(range(ROWS))
    loader.close()
    assert no_children_left()


@pytest.mark.timeout(60)
def test_a_source_dropped_after_a_failed_read_stops_its_reader(seg_url) -> None:
    """A failed read's exception, raised where it was awaited, holds that caller's frames (``self`` among
    their locals) in its traceback. The receiver thread kept the last answer it settled while it waited for
    the next one, so when a failure was a reader's last answer, a loader dropped afterwards kept its reader
    process alive until the interpreter exited (every later test in that pytest worker saw it)."""
    import asyncio
    import gc
    import time
    import weakref

    from asyncload.processes.isolated import IsolatedSource

    iso = IsolatedSource(FailingSource(seg_url, bad={3}), needs_main=False)
    iso.start()

    async def fail(src: IsolatedSource) -> None:
        with pytest.raises(OSError, match="unreadable object for sample 3"):
            await src.read([3])  # the reader's last answer: nothing is read after it

    asyncio.run(fail(iso))
    pid, ref = iso.pid, weakref.ref(iso)
    assert pid is not None
    del iso
    deadline = time.monotonic() + 5  # (its receiver thread holds it for a moment each tick)
    while gc.collect() is not None and ref() is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ref() is None
    assert no_children_left() and not reader_threads() and pids_gone([pid])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_loader_dropped_after_a_failed_read_stops_its_reader(seg_url, on_error) -> None:
    """The same through a loader, dropped (neither ``close()`` nor ``with``) after a failed or skipped read."""
    bad = 37
    opts = {"shuffle_block": 8, "shuffle_window": 32}  # blocks: the failed request is a block's part
    loader = AsyncLoader(FailingSource(seg_url, bad={bad}), batch_size=16, seed=2, on_error=on_error, **opts)
    if on_error == "raise":
        with pytest.raises(ReadError, match=f"unreadable object for sample {bad}"):
            list(loader)
    else:
        assert sorted(_indices(loader)) == [i for i in range(ROWS) if i != bad]
    pid = loader._isolated.pid
    assert pid is not None
    del loader  # what stops the reader is the loader's collection
    assert no_children_left() and not reader_threads() and pids_gone([pid])
