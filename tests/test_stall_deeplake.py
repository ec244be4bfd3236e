"""A Deep Lake store that stops answering, through the reader process and through fan-out workers.

The store is a real SeaweedFS S3 server stopped with SIGSTOP (its connections stay open, nothing answers)
and resumed with SIGCONT, as a load balancer that keeps the connection and goes silent does. Deep Lake
keeps what it fetched, so every stall here begins before the first batch, in readers that have fetched
nothing yet. ``stall_timeout`` is small so that each case takes seconds: a reader is found stuck after a
quarter of it (``recovery.read_limit``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from asyncload import AsyncLoader, DeepLakeSource, LoaderClosedError, StallError

from .conftest import forked_workers, no_children_left, pids_gone, reader_pids, reader_threads, worker_pids
from .remote_fixtures import RemoteData, read_epoch
from .timing import within


@contextlib.contextmanager
def silent(server, until: Callable[[], bool] | None = None, at_most: float = 0.0) -> Iterator[None]:
    """The server stopped (SIGSTOP to its process group) for the block, or until ``until()`` holds (then
    1.5 s more, so that what it waited for meets the silence too; ``at_most`` seconds at the most):
    resumed (SIGCONT) at the end of the block whatever happens."""
    pgid = server.pid
    assert pgid is not None
    os.killpg(pgid, signal.SIGSTOP)
    done = threading.Event()
    waiter = threading.Thread(target=_when, args=(until, at_most, done, os.killpg, pgid, signal.SIGCONT))
    if until is not None:
        waiter.start()
    try:
        yield
    finally:
        done.set()
        if until is not None:
            waiter.join()
        os.killpg(pgid, signal.SIGCONT)


def _when(until: Callable[[], bool], at_most: float, done: threading.Event, then: Callable, *args) -> None:
    """Call ``then(*args)`` 1.5 s after ``until()`` first holds, or after ``at_most`` seconds, or never if
    ``done`` is set first. A stall that lasts until a stuck reader was replaced, whatever this machine's
    load makes of the time a process takes to start."""
    end = time.monotonic() + at_most
    while not done.is_set() and time.monotonic() < end and not until():
        done.wait(0.05)
    if not done.wait(1.5):
        then(*args)


def _source(data: RemoteData) -> DeepLakeSource:
    return DeepLakeSource(data.deeplake_url, creds=data.creds())


@pytest.mark.timeout(90)
def test_a_stall_before_the_first_batch_is_ridden_out_by_replacing_the_stuck_reader(
    remote_data: RemoteData, running_seaweed, caplog
) -> None:
    # max_restarts=0: a single charged death would end the epoch, so a stall must not be one.
    with caplog.at_level(logging.INFO, logger="asyncload"):
        earlier = set(reader_pids())  # readers of earlier tests' loaders not yet collected: not this one's
        with AsyncLoader(_source(remote_data), 8, shuffle=True, stall_timeout=20, max_restarts=0) as loader:
            started = set(reader_pids())  # its reader, started with the loader
            time.sleep(1.0)  # the reader is starting or opening the dataset: nothing of it fetched yet
            t0 = time.monotonic()
            # Silent until the stuck reader was replaced (5 s after the reads went, then 1.5 s more).
            with silent(running_seaweed, until=lambda: bool(set(reader_pids()) - started), at_most=15.0):
                seen = read_epoch(iter(loader), remote_data)
                took = time.monotonic() - t0
            stats = loader.stats()
            replacements = set(reader_pids()) - started
    assert sorted(seen) == list(range(remote_data.rows))  # every row exactly once, pixels checked
    assert 5.0 <= took < within(20.0), took  # within stall_timeout
    assert stats["stalls"] >= 1 and stats["stall_wait_s"] >= 5.0, stats
    assert stats["worker_restarts"] >= 1 and replacements  # the stuck reader was replaced
    text = caplog.text
    assert f"no answer from {remote_data.deeplake_url} for " in text and "waiting up to 20 s" in text
    assert text.count("no answer from") == 1  # once per outage
    assert f"{remote_data.deeplake_url} answered again after" in text
    assert pids_gone((started - earlier) | replacements) and no_children_left() and not reader_threads()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("on_error", ["raise", "skip"])  # a stall is no sample's fault: never skipped
def test_a_store_silent_for_good_ends_in_stall_error_naming_it_within_the_deadline(
    remote_data: RemoteData, running_seaweed, on_error
) -> None:
    loader = AsyncLoader(_source(remote_data), 8, shuffle=True, stall_timeout=6, on_error=on_error)
    time.sleep(1.0)
    got: list[int] = []
    with silent(running_seaweed):
        t0 = time.monotonic()
        with pytest.raises(StallError) as info:
            for b in loader:
                got += b["index"].tolist()
        took = time.monotonic() - t0
    err = info.value
    assert 5.5 <= took < within(15.0), took  # 6 s from the reads' start (seconds on a busy machine)
    assert not got
    assert f"no answer from {remote_data.deeplake_url} for " in str(err) and "stall_timeout=6 s" in str(err)
    assert err.source == remote_data.deeplake_url and 5.5 <= err.waited_s <= took + 0.5
    assert err.indices and set(err.indices) <= set(range(remote_data.rows)) and "rows in flight" in str(err)
    # The store answers again: the same loader reads the next epoch whole (a new reader).
    loader.set_epoch(1)
    assert sorted(read_epoch(iter(loader), remote_data)) == list(range(remote_data.rows))
    loader.close()
    assert no_children_left() and not reader_threads()


@pytest.mark.timeout(120)
def test_a_store_killed_and_restarted_on_its_port_is_ridden_out_through_new_readers(
    remote_data: RemoteData, running_seaweed
) -> None:
    # Nothing listens for a while: the reader's reads get no answer (Deep Lake retries refused connections
    # inside), it is replaced, and the new reader's open waits for the store as Deep Lake's open does.
    with AsyncLoader(_source(remote_data), 8, shuffle=True, stall_timeout=20, max_restarts=0) as loader:
        started = set(reader_pids())  # its reader, started with the loader
        time.sleep(1.0)
        running_seaweed.stop(kill=True)
        done = threading.Event()  # back 1.5 s after the stuck reader was replaced (and its own start)
        until = lambda: bool(set(reader_pids()) - started)  # noqa: E731
        back = threading.Thread(target=_when, args=(until, 12.0, done, running_seaweed.start))
        back.start()
        try:
            t0 = time.monotonic()
            seen = read_epoch(iter(loader), remote_data)
            took = time.monotonic() - t0
        finally:
            back.join()
        stats = loader.stats()
    assert sorted(seen) == list(range(remote_data.rows))
    assert took < within(20.0), took  # within stall_timeout
    assert stats["stalls"] >= 1 and stats["worker_restarts"] >= 1, stats
    assert no_children_left()


# -- fan-out workers (processes=K) -------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_fan_out_workers_stuck_in_a_stall_are_replaced_and_every_row_comes_once(
    remote_data: RemoteData, running_seaweed, caplog
) -> None:
    # The workers start at the first next(), in the stall: their open of the dataset is what stalls first.
    with caplog.at_level(logging.INFO, logger="asyncload"):
        with AsyncLoader(
            _source(remote_data), 8, shuffle=True, processes=2, stall_timeout=12, max_restarts=0
        ) as loader:
            t0 = time.monotonic()
            it = iter(loader)
            # Silent until a stuck worker was replaced (then 1.5 s more): the workers' start takes seconds.
            with silent(running_seaweed, until=lambda: it.stats().worker_restarts >= 1, at_most=40.0):
                seen = read_epoch(it, remote_data)
                took = time.monotonic() - t0
            stats = loader.stats()
            last = set(worker_pids().values())  # the epoch has ended: nothing else joins them now
    assert sorted(seen) == list(range(remote_data.rows))  # every row exactly once, pixels checked
    assert 3.0 <= took < 60.0, took  # the workers' start is seconds (tens on a busy machine), then 3 s
    assert stats["stalls"] >= 1 and stats["stall_wait_s"] >= 3.0 and stats["worker_restarts"] >= 1, stats
    assert "(a stall: not counted in max_restarts)" in caplog.text
    assert f"{remote_data.deeplake_url} answered again after" in caplog.text
    assert len(last) == 2 and pids_gone(last) and no_children_left() and not forked_workers()


@pytest.mark.timeout(120)
def test_fan_out_on_a_store_silent_for_good_ends_in_stall_error_and_stops_the_workers(
    remote_data: RemoteData, running_seaweed
) -> None:
    loader = AsyncLoader(_source(remote_data), 8, shuffle=True, processes=2, stall_timeout=6)
    with silent(running_seaweed):
        it = iter(loader)
        t0 = time.monotonic()
        with pytest.raises(StallError) as info:
            next(it)
        took = time.monotonic() - t0
    err = info.value
    assert took < 60.0, took  # the workers' start (seconds, tens on a busy machine), then 6 s of silence
    assert f"no answer from {remote_data.deeplake_url} for " in str(err) and 5.5 <= err.waited_s < 8.0
    assert err.indices and set(err.indices) <= set(range(remote_data.rows))
    assert no_children_left() and not forked_workers()  # stopped at once, not settled
    loader.close()


@pytest.mark.timeout(120)
def test_close_from_another_thread_during_a_fan_out_stall_raises_loader_closed_in_the_consumer(
    remote_data: RemoteData, running_seaweed
) -> None:
    loader = AsyncLoader(_source(remote_data), 8, shuffle=True, processes=2, stall_timeout=60)
    got: list[BaseException] = []

    def consume(it) -> None:
        try:
            next(it)
        except BaseException as exc:  # noqa: BLE001 - what the consumer sees is the point
            got.append(exc)

    with silent(running_seaweed):
        it = iter(loader)
        consumer = threading.Thread(target=consume, args=(it,))
        consumer.start()
        end = time.monotonic() + 40.0
        while len(forked_workers()) < 2 and time.monotonic() < end:  # the workers started
            time.sleep(0.1)
        time.sleep(2.0)  # and wait on the silent store
        pids = forked_workers()
        assert consumer.is_alive() and len(pids) == 2
        t0 = time.monotonic()
        loader.close()
        closed_in = time.monotonic() - t0
        consumer.join(10)
    assert not consumer.is_alive() and closed_in < 3.0, closed_in
    assert len(got) == 1 and isinstance(got[0], LoaderClosedError), got  # never StopIteration
    assert f"the loader of {remote_data.deeplake_url} was closed while this epoch was being read" in str(got[0])
    assert pids_gone(pids) and no_children_left()


_CTRL_C_SCRIPT = """
import json, sys
from asyncload import AsyncLoader, DeepLakeSource
src = DeepLakeSource(sys.argv[1], creds=json.loads(sys.argv[2]))
processes = int(sys.argv[3]) if sys.argv[3] != "auto" else "auto"
loader = AsyncLoader(src, 8, shuffle=True, processes=processes)  # every setting at its default
print("built", flush=True)
sys.stdin.readline()  # the test silences the store, then says go
try:
    for batch in loader:
        print("batch", flush=True)
except KeyboardInterrupt:
    import time
    print("interrupted", time.monotonic(), flush=True)  # (fan-out: its workers were killed before this)
    raise
"""


# In `make test-slow`, not `make test`: it passes run alone and with its own file, but in the whole suite
# (and once in a run of four files) the subprocess had not exited 20 s after SIGINT, cause not found yet
# (closing note of 2026-11-27). test_shutdown covers Ctrl-C during a stall with processes=0 in the suite.
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", ["2", "auto"])  # fan-out workers; the default reader process
def test_ctrl_c_during_a_stall_is_handled_at_once_and_the_process_exits(
    remote_data: RemoteData, running_seaweed, tmp_path, processes
) -> None:
    import json
    import subprocess
    import sys

    script = tmp_path / "stalled.py"
    script.write_text(_CTRL_C_SCRIPT)
    args = [sys.executable, str(script), remote_data.deeplake_url, json.dumps(remote_data.creds()), processes]
    p = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "built"
        with silent(running_seaweed):
            p.stdin.write("go\n")
            p.stdin.flush()
            # The workers, the forkserver and the resource tracker; or the reader (started with the loader).
            end = time.monotonic() + 40.0
            while len(_descendants(p.pid)) < (4 if processes == "2" else 1) and time.monotonic() < end:
                time.sleep(0.1)
            time.sleep(2.0)  # the first reads wait on the silent store
            children = _descendants(p.pid)
            assert p.poll() is None and len(children) >= (4 if processes == "2" else 1), children
            t0 = time.monotonic()
            p.send_signal(signal.SIGINT)
            p.wait(20)
            took = time.monotonic() - t0
        out, err = p.communicate()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert "interrupted" in out and "batch" not in out, (out, err[-2000:])
    handled = float(out.split("interrupted")[1].split()[0]) - t0  # one clock for every process here
    # The KeyboardInterrupt reached the loop at once (the fan-out's workers killed by then, not waited
    # for). The whole exit measured 1.2-1.8 s on 2 cores, up to 3.1 s at a load average of 24: nearly all
    # of it the interpreter's own exit with torch and Deep Lake loaded (a bare `import torch` script takes
    # 0.5-0.8 s from its atexit hooks to its end there). The bound is the held-out one.
    assert handled < 1.0, (handled, err[-2000:])
    assert took < within(5.0), (took, err[-2000:])
    end = time.monotonic() + 5.0  # the forkserver and the resource tracker leave once their parent is gone
    while not pids_gone(children) and time.monotonic() < end:
        time.sleep(0.1)
    assert pids_gone(children)


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children of children too), from /proc."""
    found, todo = [], [pid]
    while todo:
        here = todo.pop()
        try:
            with open(f"/proc/{here}/task/{here}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            kids = []
        found += kids
        todo += kids
    return found


@pytest.mark.timeout(120)
def test_a_reader_stuck_in_an_abandoned_epoch_does_not_shorten_the_next_epochs_deadline(
    remote_data: RemoteData, running_seaweed
) -> None:
    """An epoch abandoned during a stall leaves its reads in the reader process, stuck. The next epoch
    (the store still silent) gets its whole ``stall_timeout``: its outage is dated from its own start at the
    earliest, not from the abandoned epoch's reads (a fresh policy used to date it from them, so the next
    epoch failed early, or at once when the gap was long)."""
    loader = AsyncLoader(_source(remote_data), 8, shuffle=True, stall_timeout=8, shutdown_timeout=0.5)
    time.sleep(3.0)  # the reader has imported Deep Lake and opened the dataset: its reads' clock runs at once
    with silent(running_seaweed):
        it = iter(loader)
        closer = threading.Timer(5.5, it.close)  # after one stuck reader was replaced (at 2 s)
        closer.start()
        with pytest.raises(LoaderClosedError):
            next(it)
        closer.join()
        t1 = time.monotonic()
        with pytest.raises(StallError) as info:
            next(iter(loader))
        took = time.monotonic() - t1
    print(f"\nthe next epoch after an abandoned one: StallError after {took:.1f} s: {info.value}")
    assert 6.8 <= took < within(20.0), took  # its own 8 s (the old reads' outage would have ended it ~4.5 s in)
    loader.set_epoch(1)
    assert sorted(read_epoch(iter(loader), remote_data)) == list(range(remote_data.rows))  # and then it is back
    loader.close()
    assert no_children_left()
