"""An epoch being read, as the consumer sees it: the ``Epoch`` contract and its in-process form.

Every shape of epoch asyncload hands out is an ``Epoch``: ``EpochIterator`` (read by this process's
loop thread), the fan-out's epoch (read by worker processes) and what the torch adapter returns inside a
DataLoader worker. The contract is what a consumer, a checkpoint and a test may rely on:

- ``next()`` blocks until the next batch (no spinning), raises the epoch's error at its place in the
  order, and ``StopIteration`` at the end;
- ``close()`` stops whatever reads the epoch, idempotently; so do ``with``, ``break`` + garbage
  collection and interpreter exit;
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
from collections.abc import Iterator
from typing import Any

from ._closing import Closing
from ._loop import LoopKind, LoopThread
from ._protocol import EMPTY, END, Failure
from .errors import WorkerError
from .pipeline import Pipeline
from .plan import Plan
from .state import EpochProgress
from .stats import Stats

log = logging.getLogger("asyncload")


class Epoch(Closing, Iterator[Any], abc.ABC):
    """The contract of one epoch being read (module docstring). Subclasses set ``_progress`` and
    ``_stats`` and implement ``__next__``, ``close`` and ``__len__``."""

    _progress: EpochProgress
    _stats: Stats

    def __iter__(self) -> Epoch:
        return self

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


class EpochIterator(Epoch):
    """One epoch read in this process. Owns the loop thread of that epoch; ``close()`` (or ``del``)
    stops it. Use it as a context manager, or rely on ``break`` + garbage collection; both stop every
    thread."""

    def __init__(
        self, plan: Plan, progress: EpochProgress, *, loop: LoopKind, cpu_workers: int, shutdown_timeout: float
    ) -> None:
        self._plan = plan
        self._progress = progress
        self._timeout = shutdown_timeout
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stats = Stats()
        self._lt = LoopThread(loop=loop, cpu_workers=cpu_workers, owner_close=self.close)
        self._pipeline = Pipeline(plan, self._out, self._lt, self._stats)
        self._future: concurrent.futures.Future[None] | None = None
        self._closed = False  # no more batches for the consumer
        self._stopped = False  # the loop thread is joined

    def _start(self) -> None:
        """Start the loop thread and the pipeline: on the first ``next()``, in the process that iterates."""
        self._stats.started = time.perf_counter()
        self._lt.start()
        self._future = self._lt.submit(self._pipeline.run())

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return len(self._plan.batches)

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        if self._future is None:
            self._start()
        assert self._future is not None
        st = self._stats
        t0 = st.waiting_since = time.perf_counter()
        while True:
            try:
                item = self._out.get(timeout=1.0)
            except queue.Empty:
                if self._future.done() or not self._lt.running:
                    self._die()
                continue
            if item is END:
                st.wait_s += time.perf_counter() - t0
                st.waiting_since = None
                self._report_skipped()
                self.close()
                raise StopIteration
            if isinstance(item, Failure):
                st.waiting_since = None
                self.close()
                raise item.exc
            self._lt.call_soon(self._pipeline.release_slot)
            seq, count, batch = item
            self._progress.mark(seq)
            if batch is not EMPTY:
                break
        st.wait_s += time.perf_counter() - t0
        st.waiting_since = None
        st.batches_yielded += 1
        st.samples_yielded += count
        if st.first_batch_s is None:
            st.first_batch_s = time.perf_counter() - st.started
        return batch

    def _report_skipped(self) -> None:
        st = self._stats
        if st.skipped:
            shown = ", ".join(f"{i} ({why})" for i, why in st.skipped_samples[:5])
            log.warning(
                "asyncload: skipped %d samples in epoch %d of %s (on_error='skip'): %s%s",
                st.skipped, self._progress.epoch, self._plan.source.url, shown, ", ..." if st.skipped > 5 else "",
            )  # fmt: skip

    def _die(self) -> None:
        """The pipeline ended without saying so: report why instead of waiting forever."""
        cause: BaseException | None = None
        if self._future is not None and self._future.done() and not self._future.cancelled():
            cause = self._future.exception()
        self.close()
        raise WorkerError(f"asyncload's loop thread for {self._plan.source.url} ended unexpectedly") from cause

    def close(self) -> None:
        """Stop issuing reads, wait (bounded) for those in flight, stop and join the loop thread.

        Idempotent, and safe to call again when a first call was interrupted (Ctrl-C while waiting for
        reads in flight): the stop counts as done only once the loop thread is joined.
        """
        if self._stopped:
            return
        if not self._closed:
            self._closed = True
            self._stats.finished = time.perf_counter()
            self._out.put(END)  # wakes a consumer blocked in next() on another thread (a pin thread)
        if self._future is not None and self._lt.running:
            self._lt.call_soon(self._pipeline.stop)
            try:
                self._future.result(self._timeout)
            except concurrent.futures.TimeoutError:
                # Reads are still in flight: closing the loop now would let the store complete a future
                # into a closed loop (Deep Lake aborts the process). Leave the daemon thread to finish.
                log.warning(
                    "asyncload: reads from %s still in flight after %.1fs; leaving the loop thread to finish them",
                    self._plan.source.url, self._timeout,
                )  # fmt: skip
                return
            except Exception:  # noqa: BLE001 - errors were delivered to the consumer already
                pass
        self._stopped = self._lt.stop(self._timeout)


__all__ = ["Epoch", "EpochIterator"]
