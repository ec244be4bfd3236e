"""An epoch being read, as the consumer sees it: the ``Epoch`` contract and its in-process form.

Every shape of epoch asyncload hands out is an ``Epoch``: ``EpochIterator`` (read by this process's
loop thread), the fan-out's epoch (read by worker processes) and what the torch adapter returns inside a
DataLoader worker. The contract is what a consumer, a checkpoint and a test may rely on:

- ``next()`` blocks until the next batch (no spinning), raises the epoch's error at its place in the
  order, and ``StopIteration`` at the end, and only there: every batch of the epoch was yielded;
- ``close()`` stops whatever reads the epoch, idempotently; so do ``with``, ``break`` + garbage
  collection and interpreter exit. A consumer waiting in ``next()`` on another thread, or calling it
  after, gets ``LoaderClosedError`` (an epoch stopped is not an epoch ended);
- ``state()`` is the ``EpochProgress`` of the batches the consumer took (the one resume-state type);
- ``stats()`` are the epoch's figures, summed over every process that read it.

Only batches the consumer took count in ``state()``: batches read ahead are read again after a resume,
never lost or repeated.
"""

from __future__ import annotations

import abc
import concurrent.futures
import logging
import queue
import time
from collections.abc import Callable, Iterator
from typing import Any, Self

from ..errors import LoaderClosedError, WorkerError
from ..runtime.loop import ExitOrder, LoopKind, LoopThread, exiting, on_exit, start_thread
from .pipeline import Pipeline
from .plan import Plan
from .progress import EpochProgress
from .protocol import CLOSED, EMPTY, END, Failure
from .stats import Stats

log = logging.getLogger("asyncload")

#: Seconds a stop at interpreter exit (Ctrl-C) waits for reads in flight that cannot be cancelled before
#: abandoning them: healthy reads end in milliseconds, and a silent store must not hold up the exit.
EXIT_GRACE_S = 1.0


def closed_error(url: str, taken: int, total: int) -> LoaderClosedError:
    """What a consumer gets from ``next()`` on an epoch that ``close()`` stopped before its end."""
    return LoaderClosedError(
        f"the loader of {url} was closed while this epoch was being read ({taken} of {total} batches yielded): "
        "the epoch was stopped, not finished"
    )


class Epoch(Iterator[Any], abc.ABC):
    """The contract of one epoch being read (module docstring). Subclasses set ``_progress`` and
    ``_stats``, implement ``__next__``, ``close`` and ``__len__``, and register what stops them with
    ``runtime.loop.on_exit`` (so that garbage collection and interpreter exit stop them too)."""

    _progress: EpochProgress
    _stats: Stats
    #: Called once when the epoch's last batch has been taken, on the consumer's thread, before
    #: ``StopIteration``: the loader's end-of-epoch report (``engine.slowest``). Not on a stop or an error.
    on_end: Callable[[], None] | None = None

    def __iter__(self) -> Self:
        return self

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finished(self) -> None:
        """Run ``on_end`` once (subclasses call it as their epoch completes)."""
        hook, self.on_end = self.on_end, None
        if hook is not None:
            hook()

    @abc.abstractmethod
    def __next__(self) -> Any: ...

    @abc.abstractmethod
    def close(self) -> None: ...

    @abc.abstractmethod
    def __len__(self) -> int:
        """Batches this epoch yields in all (after a resume: those left)."""

    def state(self) -> EpochProgress:
        """The batches of this epoch the consumer has taken."""
        return self._progress

    def stats(self) -> Stats:
        """This epoch's figures (throughput, latency, skips), over every process that read it."""
        return self._stats

    def _waiting(self) -> float:
        """The consumer starts waiting in ``next()`` (``Stats.waiting_since``, which a live ``stats()`` reads
        as wait so far); returns when."""
        st = self._stats
        t0 = st.waiting_since = time.perf_counter()
        if st.returned_at is not None:  # the consumer's time since the last batch: its training step
            st.step_s += t0 - st.returned_at
            st.returned_at = None
        return t0

    def _waited(self, t0: float, samples: int | None = None) -> None:
        """The consumer's wait begun at ``t0`` ended with a batch of ``samples`` samples, or (None) with
        the epoch's end or close. Every kind of epoch keeps its consumer-side figures here, so that
        ``stats()`` means the same whichever process read the batches."""
        st = self._stats
        now = time.perf_counter()
        st.wait_s += now - t0
        st.waiting_since = None
        if st.batches_yielded:
            st.steady_wait_s += now - t0
        if samples is not None:
            st.returned_at = now
            st.batches_yielded += 1
            st.samples_yielded += samples
            if st.first_batch_s is None:
                st.first_batch_s = now - st.started


def report_skipped(st: Stats, epoch: int, url: str) -> None:
    """The end-of-epoch warning of ``on_error="skip"``: how many samples were left out, and the first few."""
    if st.skipped:
        shown = ", ".join(f"{i} ({why})" for i, why in st.skipped_samples[:5])
        log.warning(
            "asyncload: skipped %d samples in epoch %d of %s (on_error='skip'): %s%s",
            st.skipped, epoch, url, shown, ", ..." if st.skipped > 5 else "",
        )  # fmt: skip


class _Run:
    """What stopping an in-process epoch needs, held apart from the iterator so that its finaliser (garbage
    collection, interpreter exit) can stop it without keeping the iterator alive."""

    def __init__(self, lt: LoopThread, pipeline: Pipeline, url: str, timeout: float) -> None:
        self.lt = lt
        self.pipeline = pipeline
        self.url = url
        self.timeout = timeout
        self.future: concurrent.futures.Future[None] | None = None
        self.stopped = False  # the loop thread is joined

    def stop(self) -> None:
        """Stop issuing reads, cancel those in flight (or, where the source forbids it, wait for them up
        to ``timeout``, then abandon them), stop and join the loop thread.

        At interpreter exit (Ctrl-C) the wait is ``EXIT_GRACE_S``: a silent store must not hold up the
        exit. Abandoned reads that cannot be cancelled keep the loop thread, a daemon, until they end
        (``LoopThread.linger``): closing the loop under them would abort the process (Deep Lake).
        Idempotent, and safe to call again when a first call was interrupted (Ctrl-C while waiting for
        reads in flight): the stop counts as done only once the loop thread is joined or left lingering.
        """
        if self.stopped:
            return
        if self.lt.in_loop_thread():  # a garbage-collection pass on the loop thread: it cannot wait for itself
            start_thread(self.stop, name="asyncload-stop")
            return
        timeout = EXIT_GRACE_S if exiting() else self.timeout
        if self.future is not None and self.lt.running:
            self.lt.call_soon(self.pipeline.stop)
            try:
                self.future.result(timeout)
            except concurrent.futures.TimeoutError:
                log.warning(
                    "asyncload: reads from %s still in flight after %.1f s; abandoning them (they cannot be "
                    "cancelled: the loop thread stays until they end)", self.url, timeout,
                )  # fmt: skip
                self.lt.call_soon(self.pipeline.abandon)
                try:
                    self.future.result(timeout)
                except concurrent.futures.TimeoutError:
                    return  # the loop thread itself is stuck: leave the daemon
                except Exception:  # noqa: BLE001 - errors were delivered to the consumer already
                    pass
            except Exception:  # noqa: BLE001 - errors were delivered to the consumer already
                pass
        self.stopped = self.lt.stop(timeout)


class EpochIterator(Epoch):
    """One epoch read in this process, on a loop thread of its own that starts on the first ``next()``;
    ``close()``, ``with``, ``break`` + garbage collection and interpreter exit all stop it."""

    def __init__(
        self, plan: Plan, progress: EpochProgress, *, loop: LoopKind, cpu_workers: int, shutdown_timeout: float,
        report_skips: bool = True,
    ) -> None:  # fmt: skip
        self._plan = plan
        self._report_skips = report_skips  # False in a fan-out worker: the parent reports the whole epoch
        self._progress = progress
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stats = Stats()
        lt = LoopThread(loop=loop, cpu_workers=cpu_workers)
        self._pipeline = Pipeline(plan, self._out, lt, self._stats)
        self._run = _Run(lt, self._pipeline, plan.source.url, shutdown_timeout)
        self._finalizer = on_exit(self, ExitOrder.WORK, self._run.stop)
        self._closed = False  # no more batches for the consumer
        self._ended = False  # every batch of the epoch was yielded: only then StopIteration
        self._error: BaseException | None = None  # the epoch's error, raised again by a later next()

    def _start(self) -> None:
        """Start the loop thread and the pipeline: on the first ``next()``, in the process that iterates."""
        self._stats.started = time.perf_counter()
        self._run.lt.start()
        self._run.future = self._run.lt.submit(self._pipeline.run())

    def __len__(self) -> int:
        return len(self._plan.batches)

    def __next__(self) -> Any:
        if self._closed:
            if self._ended:
                raise StopIteration
            if self._error is not None:
                raise self._error
            raise closed_error(self._plan.source.url, self._stats.batches_yielded, len(self._plan.batches))
        if self._run.future is None:
            self._start()
        future = self._run.future
        assert future is not None
        st = self._stats
        t0 = since = self._waiting()
        while True:
            try:
                item = self._out.get(timeout=1.0)
            except queue.Empty:
                if not future.done() and self._run.lt.running:
                    continue
                try:  # the pipeline puts END before its future is done: a wait that timed out just before END
                    item = self._out.get_nowait()  # arrived finds it now, and only an empty queue is a death
                except queue.Empty:
                    self._die()
            if item is END:  # the pipeline's: every batch before it was taken, so the epoch is complete
                self._waited(t0)
                self._ended = True
                self._report_skipped()
                self.close()
                self._finished()
                raise StopIteration
            if item is CLOSED or self._closed:  # close() from another thread: stopped, not finished
                self._waited(t0)
                raise closed_error(self._plan.source.url, st.batches_yielded, len(self._plan.batches))
            if isinstance(item, Failure):
                st.waiting_since = None
                self._error = item.exc
                self.close()
                raise item.exc
            self._run.lt.call_soon(self._pipeline.release_slot)
            now = time.perf_counter()
            st.taken(since, now)  # where the wait went (``Stats.taken``)
            since = now
            seq, count, batch = item
            self._progress.mark(seq)
            if batch is not EMPTY:
                break
        self._waited(t0, count)
        return batch

    def _report_skipped(self) -> None:
        if self._report_skips:
            report_skipped(self._stats, self._progress.epoch, self._plan.source.url)

    def _die(self) -> None:
        """The pipeline ended without saying so: report why instead of waiting forever."""
        future = self._run.future
        cause: BaseException | None = None
        if future is not None and future.done() and not future.cancelled():
            cause = future.exception()
        self.close()
        raise WorkerError(f"asyncload's loop thread for {self._plan.source.url} ended unexpectedly") from cause

    def close(self) -> None:
        """Stop issuing reads, wait (bounded) for those in flight, stop and join the loop thread
        (see ``_Run.stop``); idempotent."""
        if not self._closed:
            self._closed = True
            self._stats.finished = time.perf_counter()
            self._out.put(CLOSED)  # wakes a consumer blocked in next() on another thread: LoaderClosedError
        self._run.stop()
        if self._run.stopped:
            self._finalizer.detach()


__all__ = ["Epoch", "EpochIterator"]
