"""A store that stops answering, through a real SeaweedFS S3 server: stalled (SIGSTOP: connections open, no
answers), killed and restarted on the same port, or silent for good.

What is checked, and why this way:

- **Ridden out, exactly once.** A stall shorter than ``stall_timeout`` mid-epoch and a restart on the same
  port end with every row exactly once; the object store's breaker held the reads as one outage (counted
  in ``retry_stats()``, nothing given up, the budget nearly full) and the loader counted the stall.
- **A deadline, never a hang.** Silent for good: ``StallError`` (a ``ReadError``) naming the store's URL,
  the wait and the rows in flight, within the deadline, for an object store and for Deep Lake read in
  this process (``processes=0``: its stuck read cannot be cancelled; it is abandoned and ends on its own
  once the server answers again).
- **The budget still ends a store that answers 500 for good** (a ``ReadError``, not a stall).
- **close() is not an end.** A consumer waiting in ``next()`` during a stall when another thread calls
  ``close()`` gets ``LoaderClosedError``, from ``AsyncLoader`` and from a ``DataLoader`` over
  ``AsyncIterableDataset``.

The stall is real (the server's process group stopped by signal) and so are the clocks; ``stall_timeout``
is small (5-10 s) to keep the suite short. Every test resumes the server however it ends.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch.utils.data

from asyncload import (
    AsyncIterableDataset,
    AsyncLoader,
    DeepLakeSource,
    LoaderClosedError,
    ObjectStoreSource,
    ReadError,
    RetryPolicy,
    SourceError,
    StallError,
    Timeouts,
)
from harness.faults import Fault, FaultProxy
from harness.seaweed import SeaweedServer

from .conftest import loop_threads, wait_no_loop_threads
from .remote_fixtures import RemoteData, read_epoch
from .timing import within

# Short request deadlines, so that a silent server fails requests (and opens the breaker) within a test.
QUICK = Timeouts(connect=1.0, read=1.5, total=10.0)


class Freezer:
    """SIGSTOP / SIGCONT the S3 server's whole process group (connections stay open, nothing answers)."""

    def __init__(self, server: SeaweedServer) -> None:
        self.server = server
        self.frozen = False

    def stop(self) -> None:
        assert self.server.pid is not None
        os.killpg(self.server.pid, signal.SIGSTOP)
        self.frozen = True

    def cont(self) -> None:
        if self.frozen and self.server.pid is not None:
            os.killpg(self.server.pid, signal.SIGCONT)
        self.frozen = False

    def later(self, seconds: float, action: Callable[[], None]) -> threading.Timer:
        t = threading.Timer(seconds, action)
        t.daemon = True
        t.start()
        return t


@pytest.fixture
def freezer(remote_data: RemoteData, running_seaweed: SeaweedServer) -> Iterator[Freezer]:
    f = Freezer(running_seaweed)
    try:
        yield f
    finally:
        f.cont()  # whatever happened: the session's server answers again


def files(data: RemoteData, **kw: object) -> ObjectStoreSource:
    return ObjectStoreSource(data.files_url, creds=data.creds(), **kw).open()  # type: ignore[arg-type]


def silent_until(
    freezer: Freezer, it: Iterator[object], error: type[BaseException] = StallError
) -> tuple[BaseException, float, float]:
    """Stop the store and read ``it`` on until it raises ``error`` (it must): the error, when the silence
    began, and the seconds it took."""
    freezer.stop()
    t0 = time.monotonic()
    with pytest.raises(error) as info:
        for _ in it:
            pass
    return info.value, t0, time.monotonic() - t0


def exactly_once(seen: list[int], rows: int) -> None:
    counts = Counter(seen)
    assert sorted(counts) == list(range(rows)), f"lost: {sorted(set(range(rows)) - set(counts))}"
    assert max(counts.values()) == 1, f"repeated: {[i for i, n in counts.items() if n > 1]}"


@pytest.mark.timeout(60)
def test_object_store_rides_out_a_stall_mid_epoch_exactly_once(
    remote_data: RemoteData, freezer: Freezer, caplog: pytest.LogCaptureFixture
) -> None:
    """Stalled 5 s mid-epoch; requests time out after 1.5 s, so the breaker opens, probes, and releases the
    reads when the server answers again: every row once, no request given up, nothing charged per read."""
    caplog.set_level(logging.INFO, logger="asyncload")
    src = files(remote_data, timeouts=QUICK)
    loader = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1, stall_timeout=10)
    it = iter(loader)
    seen = next(it)["index"].tolist()
    freezer.stop()
    t0 = time.monotonic()
    freezer.later(5.0, freezer.cont)
    read_epoch(it, remote_data, seen)
    wall = time.monotonic() - t0
    exactly_once(seen, remote_data.rows)
    rs, st = src.retry_stats(), loader.stats()
    print(f"\nstall 5 s: epoch done {wall:.1f} s after it began; stalls={st['stalls']} waited {st['stall_wait_s']:.1f} s; "
          f"retry stats {rs}")  # fmt: skip
    assert wall >= 4.5  # the stall really held the epoch
    assert rs["gave_up"] == 0 and rs["outages"] >= 1 and rs["outage_waits"] > 0, rs
    assert rs["budget_left"] >= rs["budget"] - 2 * 8, rs  # at most the failures before the breaker opened
    assert st["stalls"] >= 1 and st["stall_wait_s"] >= 3.0, st
    said = [r.getMessage() for r in caplog.records if r.name == "asyncload"]
    assert any("no answer from" in m and "waiting up to 10 s" in m for m in said), said  # warned once...
    assert any("answered again after" in m for m in said), said  # ... and said when it answered
    wait_no_loop_threads()


@pytest.mark.timeout(90)
def test_object_store_rides_out_a_restart_on_the_same_port(remote_data: RemoteData, freezer: Freezer) -> None:
    """Killed mid-epoch and started again on the same port 3 s later: refused connections open the breaker
    (one outage, not a retry storm) and the epoch completes exactly once when the server is back."""
    server = freezer.server
    src = files(remote_data)
    loader = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1, stall_timeout=40)
    it = iter(loader)
    seen = next(it)["index"].tolist()
    port = server.port
    server.stop(kill=True)
    t0 = time.monotonic()
    restarted: list[float] = []

    def back() -> None:
        server.start()
        restarted.append(time.monotonic() - t0)

    freezer.later(3.0, back)
    read_epoch(it, remote_data, seen)
    wall = time.monotonic() - t0
    exactly_once(seen, remote_data.rows)
    rs = src.retry_stats()
    print(f"\nrestart: server answering after {restarted[0]:.1f} s, epoch done after {wall:.1f} s; {rs}")
    assert server.port == port and restarted
    assert rs["gave_up"] == 0 and rs["outages"] >= 1, rs
    assert rs["budget_left"] >= rs["budget"] - 2 * 8, rs
    wait_no_loop_threads()


@pytest.mark.timeout(60)
def test_object_store_silent_for_good_ends_in_a_stall_error_at_the_deadline(
    remote_data: RemoteData, freezer: Freezer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="asyncload.stall")  # what `asyncload load` shows while a stall lasts
    src = files(remote_data)  # default timeouts: the requests are still waiting when the deadline comes
    loader = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1, stall_timeout=5)
    it = iter(loader)
    next(it)
    err, _, wall = silent_until(freezer, it)
    text = str(err)
    print(f"\nsilent for good: {type(err).__name__} after {wall:.1f} s: {text}")
    assert isinstance(err, ReadError)
    assert 4.0 <= wall < within(9.0)
    assert remote_data.files_url in text and "stall_timeout=5 s" in text and "rows in flight" in text, text
    assert err.waited_s >= 5.0 and err.indices and all(0 <= i < remote_data.rows for i in err.indices)
    assert remote_data.server.secret_key not in text
    with pytest.raises(StallError):  # the epoch's error again, never a StopIteration
        next(it)
    wait_no_loop_threads()  # cancelled HTTP reads: nothing lingers
    assert loader.stats()["stalls"] == 0  # not ridden out
    shown = [r.getMessage() for r in caplog.records if r.name == "asyncload.stall"]
    assert shown and all(re.fullmatch(rf"waiting for {remote_data.files_url}: no answer for \d+ s \(deadline 5 s\)", m)
                         for m in shown), shown  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if r.name == "asyncload" and r.levelno == logging.WARNING]
    assert any("no answer from" in m and "waiting up to 5 s" in m for m in warned), warned


@pytest.mark.timeout(60)
def test_the_budget_still_ends_a_store_that_answers_500_for_good(
    remote_data: RemoteData, running_seaweed: SeaweedServer
) -> None:
    """Answers that are errors are not an outage: the breaker stays closed and the retry budget ends it."""
    with FaultProxy(("127.0.0.1", running_seaweed.port)) as proxy:
        creds = dict(remote_data.creds(), endpoint_url=proxy.url)
        policy = RetryPolicy(max_attempts=50, base_delay=0.01, max_delay=0.05, budget=40)
        src = ObjectStoreSource(remote_data.files_url, creds=creds, retry=policy).open()
        proxy.schedule.always(Fault.HTTP_500, match="/files/")
        t0 = time.monotonic()
        with pytest.raises(ReadError) as info:
            list(AsyncLoader(src, batch_size=8, concurrency=16, stall_timeout=30))
        wall = time.monotonic() - t0
    err = info.value
    rs = src.retry_stats()
    assert not isinstance(err, StallError)
    assert "retry budget is exhausted" in str(err) and "HTTP 500" in str(err), str(err)
    assert wall < within(10.0) and rs["outages"] == 0 and rs["budget_exhausted"] >= 1, rs
    wait_no_loop_threads()


def _close_during_stall(freezer: Freezer, consume: Callable[[], object], close: Callable[[], None]) -> BaseException:
    """Stall the server, call ``close()`` from another thread 1.5 s later while ``consume()`` waits for a
    batch in this one; what ``consume()`` raised."""
    freezer.stop()
    timer = freezer.later(1.5, close)
    t0 = time.monotonic()
    try:
        consume()
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        got: BaseException = exc
    else:
        raise AssertionError("the consumer finished the epoch during a stall")
    finally:
        timer.join()
    assert time.monotonic() - t0 < 5.0, "close() did not reach the waiting consumer promptly"
    return got


@pytest.mark.timeout(60)
def test_close_from_another_thread_during_a_stall_raises_loader_closed(
    remote_data: RemoteData, freezer: Freezer
) -> None:
    loader = AsyncLoader(files(remote_data), batch_size=8, concurrency=16, prefetch=1, stall_timeout=30)
    it = iter(loader)
    seen = next(it)["index"].tolist()

    def consume() -> None:
        for b in it:
            seen.extend(b["index"].tolist())

    err = _close_during_stall(freezer, consume, loader.close)
    assert isinstance(err, LoaderClosedError), repr(err)
    assert "was closed while this epoch was being read" in str(err) and remote_data.files_url in str(err)
    assert len(seen) < remote_data.rows
    with pytest.raises(LoaderClosedError):
        next(it)
    freezer.cont()
    wait_no_loop_threads()


@pytest.mark.timeout(60)
def test_close_of_the_dataset_during_a_stall_reaches_a_dataloader_consumer(
    remote_data: RemoteData, freezer: Freezer
) -> None:
    ds = AsyncIterableDataset(files(remote_data), batch_size=8, concurrency=16, prefetch=1, stall_timeout=30)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0)
    batches = iter(dl)
    next(batches)
    err = _close_during_stall(freezer, lambda: list(batches), ds.close)
    assert isinstance(err, LoaderClosedError), repr(err)
    freezer.cont()
    wait_no_loop_threads()


@pytest.mark.timeout(90)
def test_deep_lake_in_this_process_silent_for_good_ends_in_a_stall_error(
    remote_data: RemoteData, freezer: Freezer
) -> None:
    """``processes=0``: Deep Lake sets no deadline and its future cannot be cancelled. The watchdog raises
    ``StallError`` at the deadline; the stuck read is abandoned, its loop thread lingering until the read
    ends (here: once the server answers again), never closed under it."""
    src = DeepLakeSource(remote_data.deeplake_url, creds=remote_data.creds())
    loader = AsyncLoader(src, batch_size=8, concurrency=16, processes=0, stall_timeout=5)
    it = iter(loader)
    freezer.stop()  # before the first batch: Deep Lake has fetched no chunk yet (it keeps what it fetched)
    t0 = time.monotonic()
    with pytest.raises(StallError) as info:
        next(it)
    wall = time.monotonic() - t0
    text = str(info.value)
    print(f"\nDeep Lake, processes=0, silent for good: StallError after {wall:.1f} s: {text}")
    assert 4.0 <= wall < within(9.0)
    assert remote_data.deeplake_url in text and "cannot be cancelled" in text, text
    assert loop_threads()  # the abandoned read's loop lingers while the store is silent
    freezer.cont()
    wait_no_loop_threads(30.0)  # the read answered; the loop stopped itself
    loader.close()


@pytest.mark.timeout(60)
def test_a_read_outside_a_loader_is_bounded_by_the_breaker(remote_data: RemoteData, freezer: Freezer) -> None:
    """``source.read`` with no loader (no watchdog): reads waiting at the open breaker give up a little
    past the source's stall timeout, as ``StallError`` naming the store."""
    import asyncio

    src = files(remote_data, timeouts=QUICK)
    src.set_stall_timeout(0.5)  # waits at the open breaker end 0.5 + 5 s after it opened
    freezer.stop()
    t0 = time.monotonic()
    with pytest.raises(StallError) as info:
        asyncio.run(src.read([0, 1, 2, 3]))  # 8 GETs: each times out after 1.5 s, which opens the breaker
    wall = time.monotonic() - t0
    assert 5.0 <= wall < within(15.0), wall
    assert remote_data.files_url in str(info.value) and "has not answered" in str(info.value), str(info.value)
    assert src.retry_stats()["outage_waits"] >= 1


@pytest.mark.timeout(60)
def test_close_during_a_stall_of_deep_lake_in_this_process_raises_loader_closed(
    remote_data: RemoteData, freezer: Freezer
) -> None:
    """``processes=0``: the consumer gets ``LoaderClosedError`` at once; ``close()`` waits
    ``shutdown_timeout`` for the read it cannot cancel, then abandons it (its loop lingers until it ends)."""
    src = DeepLakeSource(remote_data.deeplake_url, creds=remote_data.creds())
    loader = AsyncLoader(src, batch_size=8, concurrency=16, processes=0, stall_timeout=30, shutdown_timeout=2)
    it = iter(loader)
    closed: list[float] = []

    def close() -> None:
        t = time.monotonic()
        loader.close()
        closed.append(time.monotonic() - t)

    err = _close_during_stall(freezer, lambda: next(it), close)  # stalled before the first batch
    assert isinstance(err, LoaderClosedError), repr(err)
    assert 1.5 <= closed[0] < 6.0, closed  # shutdown_timeout, then abandoned: not a hang
    freezer.cont()
    wait_no_loop_threads(30.0)


@pytest.mark.timeout(120)
def test_object_store_is_read_again_after_an_outage_longer_than_the_breakers_limit(
    remote_data: RemoteData, freezer: Freezer
) -> None:
    """Silent until the epoch ends in ``StallError``, then silent on past the breaker's ``max_outage``
    (stall_timeout + 5 s) with nobody reading, then answering again: the store proves it is back at the next
    read (a probe), so the same loader's next epoch (a retried epoch), a new loader over the same source and
    a read outside any loader all read every row exactly once. (The breaker used to stay open for the life
    of the source: every later read failed unsent, "failed after 0 attempts".)"""
    src = files(remote_data, timeouts=QUICK)
    loader = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1, stall_timeout=4)
    it = iter(loader)
    next(it)
    _, t0, _ = silent_until(freezer, it)
    breaker = src._breaker  # noqa: SLF001 - the state under test: open, and past its limit below
    assert breaker.is_open or src.retry_stats()["outage_waits"] == 0
    time.sleep(max(0.0, t0 + breaker.max_outage + 2.0 - time.monotonic()))  # the outage outlasts max_outage
    freezer.cont()
    t1 = time.monotonic()
    exactly_once(read_epoch(iter(loader), remote_data), remote_data.rows)  # the same loader, a retried epoch
    again = time.monotonic() - t1
    exactly_once(read_epoch(iter(loader), remote_data), remote_data.rows)  # and the one after
    fresh = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1, stall_timeout=4)
    exactly_once(read_epoch(iter(fresh), remote_data), remote_data.rows)  # a new loader, the same source
    rs = src.retry_stats()
    print(f"\nback after an outage past max_outage: the retried epoch took {again:.1f} s; {rs}")
    assert not breaker.is_open and rs["outages"] >= 1, rs
    fresh.close()
    loader.close()
    wait_no_loop_threads()


@pytest.mark.timeout(120)
def test_a_new_outage_after_a_long_one_is_ridden_out_again(remote_data: RemoteData, freezer: Freezer) -> None:
    """After an outage that ended an epoch and outlasted the breaker's limit, a second, short stall in the
    next epoch is ridden out exactly once: the breaker's clock starts again with each outage."""
    src = files(remote_data, timeouts=QUICK)
    loader = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1, stall_timeout=4)
    it = iter(loader)
    next(it)
    _, t0, _ = silent_until(freezer, it)
    time.sleep(max(0.0, t0 + src._breaker.max_outage + 1.0 - time.monotonic()))  # noqa: SLF001
    freezer.cont()
    loader2 = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1, stall_timeout=10)
    it2 = iter(loader2)
    seen = next(it2)["index"].tolist()
    freezer.stop()
    freezer.later(3.0, freezer.cont)
    read_epoch(it2, remote_data, seen)
    exactly_once(seen, remote_data.rows)
    assert loader2.stats()["stalls"] >= 1
    loader.close()
    loader2.close()
    wait_no_loop_threads()


@pytest.mark.timeout(90)
def test_one_silent_read_ends_in_a_stall_error_at_stall_timeout_not_a_timeout_before_it(
    remote_data: RemoteData, freezer: Freezer
) -> None:
    """One read in flight on a silent store: its attempts time out one by one (too few to open the breaker
    soon), and the request's own budget (``max_elapsed=3``) used to end it first, as a plain
    ``ReadError(TimeoutError)``. Now the silence is bounded only by ``stall_timeout``: ``StallError`` at it."""
    policy = RetryPolicy(max_elapsed=3.0, max_attempts=2)
    src = files(remote_data, timeouts=QUICK, retry=policy)
    loader = AsyncLoader(src, batch_size=1, concurrency=1, prefetch=1, stall_timeout=8, hedge=None)
    it = iter(loader)
    next(it)
    err, _, wall = silent_until(freezer, it, ReadError)
    print(f"\none silent read: {type(err).__name__} after {wall:.1f} s: {err}")
    assert isinstance(err, StallError), repr(err)
    assert 7.0 <= wall < within(14.0), wall
    assert "stall_timeout=8 s" in str(err), str(err)
    freezer.cont()
    loader.close()
    wait_no_loop_threads()


@pytest.mark.timeout(60)
def test_a_request_that_times_out_while_the_store_answers_others_is_still_charged(
    remote_data: RemoteData, running_seaweed: SeaweedServer
) -> None:
    """The silence exemption is the store's, not a request's: an object whose GETs hang while other objects
    are being served still fails after its ``max_attempts`` (a ``ReadError(TimeoutError)``, not a wait until
    the stall deadline). (A hanging object read with nothing else in flight cannot be told from a silent
    store: that one is bounded by ``stall_timeout``, as above.)"""
    import asyncio

    with FaultProxy(("127.0.0.1", running_seaweed.port)) as proxy:
        creds = dict(remote_data.creds(), endpoint_url=proxy.url)
        policy = RetryPolicy(max_attempts=3, base_delay=0.01, max_delay=0.05)
        src = ObjectStoreSource(remote_data.files_url, creds=creds, retry=policy,
                                timeouts=Timeouts(connect=1.0, read=1.0, total=5.0)).open()  # fmt: skip
        src.set_stall_timeout(60)
        proxy.schedule.always(Fault.STALL, match="000003", stall_s=30.0)

        async def main() -> tuple[BaseException | None, int]:
            hung = asyncio.ensure_future(src.read([3]))
            served = 0
            while not hung.done():  # the store answers other reads meanwhile
                await src.read([0, 1, 2, 4])
                served += 1
                await asyncio.sleep(0.05)
            return hung.exception(), served

        t0 = time.monotonic()
        err, served = asyncio.run(main())
        wall = time.monotonic() - t0
    print(f"\none hanging object among served ones: {type(err).__name__} after {wall:.1f} s ({served} reads served)")
    assert isinstance(err, ReadError) and not isinstance(err, StallError), repr(err)
    assert isinstance(err, TimeoutError) and "000003" in str(err) and "3 attempts" in str(err), str(err)
    assert wall < within(20.0) and served > 3, wall


@pytest.mark.timeout(180)
def test_dataloader_workers_that_cannot_open_the_store_raise_a_named_error_then_read_again(
    remote_data: RemoteData, running_seaweed: SeaweedServer
) -> None:
    """Persistent DataLoader workers whose epoch starts while the store refuses connections: each worker's
    open fails its probe, and the training loop gets that named error from ``next()``, promptly, also when
    it retries the epoch (a persistent worker's next ``iter()``: raised there, it ended the worker inside
    DataLoader's resume, and the DataLoader waited for it for ever: found by the soak). Once the store is
    back, the next epoch reads every row exactly once."""
    from .conftest import WORKER_START

    with FaultProxy(("127.0.0.1", running_seaweed.port)) as proxy:
        creds = dict(remote_data.creds(), endpoint_url=proxy.url)
        ds = AsyncIterableDataset(ObjectStoreSource(remote_data.files_url, creds=creds), batch_size=8, shuffle=True)
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                                         multiprocessing_context=WORKER_START)  # fmt: skip
        proxy.schedule.down(refuse=True)
        for attempt in range(2):  # the first start (DataLoader's own set-up), then a retried epoch (a resume)
            t0 = time.monotonic()
            with pytest.raises(SourceError) as info:
                list(dl)
            took = time.monotonic() - t0
            assert "unreachable" in str(info.value) and took < 60.0, (attempt, took, str(info.value))
        proxy.schedule.up()
        ds.set_epoch(1)
        exactly_once([i for b in dl for i in b["index"].tolist()], remote_data.rows)
        dl._iterator._shutdown_workers()  # (persistent workers: DataLoader has no public close)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("seconds", [7.0, 14.0])
def test_fan_out_counts_a_stall_as_one_process_does_and_warns_about_it_once(
    remote_data: RemoteData,
    freezer: Freezer,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
    seconds: float,
) -> None:
    """``processes=2``: one outage is one stall in ``stats()`` (the parent's clock, fed by the workers'
    beats: counted from the pipeline's notice threshold, 5 s here, as one process counts it; a stall shorter
    than the stuck-worker limit used to be counted only in the workers, and never reached ``stats()``), and
    it is warned about once (past 10 s here), not by each worker's pipeline as well as by the parent. At 14 s,
    past the stuck-worker limit (10 s here), workers are replaced in the outage and it is still one: a worker
    that was spared by the backoff used to be killed as the store answered, on a beat from before its reads
    answered, and counted and warned as a second outage (stalls=2, ~27 s)."""
    caplog.set_level(logging.INFO, logger="asyncload")
    loader = AsyncLoader(files(remote_data, timeouts=QUICK), batch_size=8, concurrency=8, prefetch=1,
                         processes=2, stall_timeout=40)  # fmt: skip
    it = iter(loader)
    seen = next(it)["index"].tolist()
    freezer.stop()
    freezer.later(seconds, freezer.cont)
    read_epoch(it, remote_data, seen)
    exactly_once(seen, remote_data.rows)
    st = loader.stats()
    loader.close()
    said = [r.getMessage() for r in caplog.records if r.name == "asyncload"] + capfd.readouterr().err.splitlines()
    warned = [m for m in said if "no answer from" in m and "waiting up to" in m]
    print(
        f"\nfan-out, a {seconds:.0f} s stall: stalls={st['stalls']} waited {st['stall_wait_s']:.1f} s; warned {warned}"
    )
    assert st["stalls"] == 1 and seconds - 3.0 <= st["stall_wait_s"] <= seconds + 5.0, st
    assert len(warned) == (1 if seconds > 10.0 else 0), warned
