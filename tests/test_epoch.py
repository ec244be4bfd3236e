"""The ``Epoch`` contract (``engine/epoch.py``), held by every shape of epoch asyncload hands out: read by
this process's loop (``processes=0``), through the Deep Lake reader process (the default) and by fan-out
worker processes (``processes=2``). Each test runs once per shape."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter

import pytest

from asyncload import AsyncLoader, DeepLakeSource, Epoch, LoaderClosedError
from asyncload.engine.protocol import END

from .conftest import ROWS
from .resume import ids
from .sources import DelayedSource

pytestmark = pytest.mark.timeout(180)

SHAPES = {"in-process": 0, "reader process": "auto", "fan-out": 2}
BATCH = 16
BATCHES = -(-ROWS // BATCH)


def tenth_of_a_second(indices: list[int]) -> float:
    """Each request's delay (a module-level function: the source is pickled into reader and workers)."""
    return 0.1


@pytest.fixture(params=list(SHAPES), ids=list(SHAPES))
def processes(request: pytest.FixtureRequest) -> int | str:
    return SHAPES[request.param]


def test_stop_iteration_comes_at_the_end_only_and_stays(seg_url: str, processes: int | str) -> None:
    with AsyncLoader(DeepLakeSource(seg_url), batch_size=BATCH, processes=processes) as loader:
        epoch = iter(loader)
        assert isinstance(epoch, Epoch) and len(epoch) == BATCHES
        got = ids(list(epoch))
        assert Counter(i for b in got for i in b) == Counter(range(ROWS))
        for _ in range(2):  # an ended epoch stays ended
            with pytest.raises(StopIteration):
                next(epoch)
        st = epoch.stats()
        assert (st.batches_yielded, st.samples_yielded) == (BATCHES, ROWS)
        assert epoch.state().finished


def test_state_holds_the_batches_taken_and_close_is_not_an_end(seg_url: str, processes: int | str) -> None:
    with AsyncLoader(DeepLakeSource(seg_url), batch_size=BATCH, processes=processes, prefetch=2) as loader:
        epoch = iter(loader)
        for _ in range(3):
            next(epoch)
        state = epoch.state()
        assert [seq for seq in range(BATCHES) if state.done(seq)] == [0, 1, 2]  # read-ahead not counted
        assert epoch.stats().batches_yielded == 3
        epoch.close()
        epoch.close()  # idempotent
        with pytest.raises(LoaderClosedError, match="closed while this epoch was being read"):
            next(epoch)
        assert not epoch.state().finished


def test_close_from_another_thread_wakes_a_waiting_consumer(seg_url: str, processes: int | str) -> None:
    """A consumer blocked in ``next()`` gets ``LoaderClosedError`` when another thread closes the loader,
    never a ``StopIteration`` that would pass for the epoch's end."""
    slow = DelayedSource(seg_url, tenth_of_a_second)  # the epoch takes over a second: close() lands mid-way
    with AsyncLoader(slow, batch_size=BATCH, processes=processes, concurrency=BATCH) as loader:
        epoch = iter(loader)
        next(epoch)
        waiting = threading.Event()
        outcome: list[BaseException | str] = []

        def consume() -> None:
            waiting.set()
            try:
                for _ in epoch:
                    pass
                outcome.append("ended")
            except BaseException as exc:  # noqa: BLE001 - what the consumer saw is the result
                outcome.append(exc)

        t = threading.Thread(target=consume)
        t.start()
        waiting.wait(10)
        time.sleep(0.05)
        loader.close()
        t.join(30)
        assert not t.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], LoaderClosedError), outcome
    assert epoch.stats().batches_yielded < BATCHES


class _EndAfterTimeout:
    """The epoch's queue, but the wait for END times out just as END arrives, once the pipeline's future is
    done: the moment an epoch on a loaded machine can meet (its last wait timing out while the pipeline puts
    END and returns)."""

    def __init__(self, inner: object, done: threading.Event) -> None:
        self.inner, self.done, self.tricked = inner, done, False

    def put(self, item: object) -> None:
        self.inner.put(item)  # type: ignore[attr-defined]

    def get_nowait(self) -> object:
        return self.inner.get_nowait()  # type: ignore[attr-defined]

    def get(self, timeout: float | None = None) -> object:
        item = self.inner.get(timeout=timeout)  # type: ignore[attr-defined]
        if item is END and not self.tricked:
            self.tricked = True
            assert self.done.wait(10)  # the pipeline's future is done, END is in the queue...
            self.inner.put(END)  # type: ignore[attr-defined]
            raise queue.Empty  # ...and this wait timed out a moment before it came
        return item


def test_an_end_that_comes_as_a_wait_times_out_ends_the_epoch(seg_url: str) -> None:
    """Not "asyncload's loop thread ended unexpectedly": the pipeline's END is put before its future is done,
    so a wait that timed out just before END arrived finds it in the queue (seen once in a DataLoader worker
    of the full suite on 2 busy cores)."""
    with AsyncLoader(DeepLakeSource(seg_url), batch_size=BATCH, processes=0) as loader:
        epoch = iter(loader)
        done = threading.Event()
        racing = _EndAfterTimeout(epoch._out, done)  # type: ignore[attr-defined]
        epoch._out = epoch._pipeline.out = racing  # type: ignore[attr-defined]
        got = [next(epoch)]
        epoch._run.future.add_done_callback(lambda _: done.set())  # type: ignore[attr-defined]
        got += list(epoch)
        assert racing.tricked and [i for b in ids(got) for i in b] == list(range(ROWS))  # every batch, in order
