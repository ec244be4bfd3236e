"""``AsyncLoader``: the public loader, and ``EpochIterator``, the consumer side of one epoch.

The coroutines that read and assemble batches are in ``pipeline``; this module owns what the user
touches: options and their validation, epochs, resume state, and the lifetime of the loop thread.

- **No spinning.** The consumer blocks on a thread-safe queue (waking once a second only to notice a dead
  loop thread); the loop thread sleeps in its selector until a read completes.
- **Exact epochs.** Each batch of the shard's plan is read once and yielded once; the consumed ones are
  recorded (``state_dict``) so that a resumed epoch yields exactly the rest.
- **Lifetimes.** The loop thread lives for one epoch's iterator: it starts on the first ``next()`` in the
  process that iterates, and stops and is joined when the epoch ends, on ``break`` (iterator close or
  garbage collection), on an error, and at interpreter exit. Reads in flight are awaited first, bounded
  by ``shutdown_timeout``.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

from ._closing import Closing
from ._loop import LoopKind, LoopThread
from .collate import RAGGED, CollateFn, RaggedSpec, Transform
from .config import check as _check
from .errors import AsyncLoadError, ConfigError, WorkerError
from .pipeline import EMPTY, END, Failure, OnError, Pipeline, Plan
from .sampler import EpochSampler, Remainder, Shard, resolve_shard
from .sources.base import Source
from .state import EpochProgress
from .stats import Stats
from .tuning import ConcurrencyTuner

log = logging.getLogger("asyncload")

ReadMode = Literal["auto", "row", "column"]


class EpochIterator(Closing, Iterator[Any]):
    """Iterates one epoch. Owns the loop thread of that epoch; ``close()`` (or ``del``) stops it.

    Use it as a context manager, or rely on ``break`` + garbage collection; both stop every thread.
    """

    def __init__(
        self, plan: Plan, progress: EpochProgress, *, loop: LoopKind, cpu_workers: int, shutdown_timeout: float
    ) -> None:
        self._plan = plan
        self.progress = progress
        self._timeout = shutdown_timeout
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.stats = Stats()
        self._lt = LoopThread(loop=loop, cpu_workers=cpu_workers, owner_close=self.close)
        self._pipeline = Pipeline(plan, self._out, self._lt, self.stats)
        self._future: concurrent.futures.Future[None] | None = None
        self._closed = False  # no more batches for the consumer
        self._stopped = False  # the loop thread is joined

    def _start(self) -> None:
        """Start the loop thread and the pipeline: on the first ``next()``, in the process that iterates."""
        self.stats.started = time.perf_counter()
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
        st = self.stats
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
            self.progress.mark(seq)
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
        st = self.stats
        if st.skipped:
            shown = ", ".join(f"{i} ({why})" for i, why in st.skipped_samples[:5])
            log.warning(
                "asyncload: skipped %d samples in epoch %d of %s (on_error='skip'): %s%s",
                st.skipped, self.progress.epoch, self._plan.source.url, shown, ", ..." if st.skipped > 5 else "",
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
            self.stats.finished = time.perf_counter()
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




class AsyncLoader:
    """Batches from a ``Source``, read by coroutines on a background event loop.

    Parameters that matter most:
      concurrency   samples being read at once (hundreds are fine for remote stores), or "auto"
                    (default): tuned online between 1 and ``max_concurrency`` (see ``tuning``)
      max_concurrency  the most samples in flight "auto" may choose (bounds memory)
      prefetch      ready batches kept ahead of the consumer
      read_mode     "column": one request per column for a group of ``request_size`` indices;
                    "row": one request per sample and column; "auto" (default): what the source
                    measured faster (``Source.preferred_read_mode``)
      request_size  indices per column request in "column" mode (default: the batch size)
      in_order      True: batches in sampler order (reorder buffer); False: as they complete
      shuffle, seed the order of an epoch; ``set_epoch(e)`` selects the epoch (like DistributedSampler)
      rank, world_size  which rank's share of each epoch this loader serves; by default the rank of
                    the initialised ``torch.distributed`` process group (every rank of a torchrun job
                    reads its own share, exactly as ``AsyncIterableDataset`` does), else the whole epoch
      shard         the rank and DataLoader-worker share, explicitly (instead of rank/world_size)
      start_batch   leave out the rank's first N batches of every epoch this loader runs (how
                    ``AsyncIterableDataset`` resumes DataLoader workers; see ``sampler``)
      remainder     "pad" or "drop" when ranks do not divide the dataset (see ``sampler``)
      transform     per-sample callable on ``{column: array, "index": int}`` (arrays are read-only views)
      collate_fn    turns the list of (transformed) samples into a batch
      ragged        columns whose samples differ in shape: "list" (a list of tensors) or "pad"
                    (zero-padded to the batch's largest shape, with a ``<column>_mask``), for every
                    column or as ``{column: ...}``; None: raise ``CollateError``. Equal shapes always
                    stack; text columns come back as lists of ``str``
      with_index    add an ``"index"`` int64 tensor of dataset indices to default batches
      hedge         a read slower than ``hedge`` × the recent p99 latency gets a second request; the
                    first answer wins (None: never hedge). Hedges are counted in ``stats()``
      log_every     seconds between "asyncload" INFO log lines of live stats (None: off)
      processes     0 (default): read in this process; K: K spawned worker processes, each with its
                    own event loop and store handle, share the epoch (CPU-heavy transforms scale);
                    batches come back through shared memory. transform/collate_fn must be picklable
      mp_context    "spawn" (default) or "forkserver" for the worker processes
      on_error      "raise" (default): a failed read or transform raises in the consumer;
                    "skip": the bad samples are left out, counted in ``stats()`` and reported at
                    the end of the epoch (a failed group is re-read sample by sample first)
    """

    #: ``processes=K``: the persistent worker processes (``fanout.WorkerPool``), started by the first
    #: epoch's first ``next()`` and kept until ``close()`` or garbage collection.
    _pool: Any = None

    def __init__(
        self,
        source: Source[Any],
        batch_size: int = 32,
        *,
        shuffle: bool = False,
        seed: int = 0,
        concurrency: int | Literal["auto"] = "auto",
        max_concurrency: int = 512,
        prefetch: int = 4,
        in_order: bool = True,
        drop_last: bool = False,
        transform: Transform | None = None,
        collate_fn: CollateFn | None = None,
        ragged: RaggedSpec = None,
        read_mode: ReadMode = "auto",
        request_size: int | None = None,
        with_index: bool = True,
        on_error: OnError = "raise",
        remainder: Remainder = "pad",
        shard: Shard | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        start_batch: int = 0,
        cpu_workers: int | None = None,
        loop: LoopKind = "auto",
        shutdown_timeout: float = 10.0,
        log_every: float | None = None,
        hedge: float | None = 3.0,
        processes: int = 0,
        mp_context: Literal["spawn", "forkserver"] = "spawn",
    ) -> None:
        # What a fan-out worker needs to build the same loader for its share (everything but the
        # source, the shard and the fan-out itself).
        self._options: dict[str, Any] = {
            k: v for k, v in locals().items() if k not in ("self", "source", "shard", "rank", "world_size", "processes", "mp_context")
        }
        if not isinstance(source, Source):
            raise ConfigError(f"source={source!r} is not allowed: pass a Source such as DeepLakeSource(url)")
        _check("batch_size", batch_size, isinstance(batch_size, int) and batch_size >= 1, "an int >= 1")
        _check("concurrency", concurrency, concurrency == "auto" or (isinstance(concurrency, int) and not isinstance(concurrency, bool) and concurrency >= 1), "'auto' or an int >= 1")
        _check("processes", processes, isinstance(processes, int) and not isinstance(processes, bool) and processes >= 0, "an int >= 0 (0: read in this process)")
        _check("mp_context", mp_context, mp_context in ("spawn", "forkserver"), "'spawn' or 'forkserver' (never 'fork': Deep Lake and event loops do not survive it)")
        _check("hedge", hedge, hedge is None or (isinstance(hedge, (int, float)) and hedge > 1), "None or a factor > 1")
        _check("max_concurrency", max_concurrency, isinstance(max_concurrency, int) and max_concurrency >= 1, "an int >= 1")
        _check("log_every", log_every, log_every is None or (isinstance(log_every, (int, float)) and log_every > 0), "None or seconds > 0")
        _check("prefetch", prefetch, isinstance(prefetch, int) and prefetch >= 1, "an int >= 1")
        _check("read_mode", read_mode, read_mode in ("auto", "row", "column"), "'auto', 'row' or 'column'")
        _check("request_size", request_size, request_size is None or (isinstance(request_size, int) and request_size >= 1), "None or an int >= 1")
        _check("remainder", remainder, remainder in ("pad", "drop"), "'pad' or 'drop'")
        _check("start_batch", start_batch, isinstance(start_batch, int) and start_batch >= 0, "an int >= 0")
        _check("on_error", on_error, on_error in ("raise", "skip"), "'raise' or 'skip'")
        _check("loop", loop, loop in ("auto", "uvloop", "asyncio"), "'auto', 'uvloop' or 'asyncio'")
        _check("shutdown_timeout", shutdown_timeout, shutdown_timeout > 0, "a number of seconds > 0")
        _check(
            "ragged", ragged,
            ragged is None or ragged in RAGGED
            or (isinstance(ragged, Mapping) and all(isinstance(k, str) and v in RAGGED for k, v in ragged.items())),
            "None, 'list', 'pad' or a dict of column -> 'list' | 'pad'",
        )  # fmt: skip
        for name, fn in (("transform", transform), ("collate_fn", collate_fn)):
            _check(name, fn, fn is None or callable(fn), "None or a callable")
        if cpu_workers is None:
            cpu_workers = min(4, os.cpu_count() or 1)
        _check("cpu_workers", cpu_workers, isinstance(cpu_workers, int) and cpu_workers >= 1, "an int >= 1")
        try:
            shard, shard_from = resolve_shard(shard, rank, world_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if with_index and "index" in source.columns:
            raise ConfigError("with_index=True is not allowed with a column named 'index': pass with_index=False")
        self.source = source.open()
        self.batch_size = batch_size
        self.concurrency: int | Literal["auto"] = concurrency
        self.max_concurrency = max_concurrency
        self.log_every = log_every
        self.hedge = hedge
        self.processes = processes
        self.mp_context = mp_context
        self.shard = shard
        self.prefetch = prefetch
        self.in_order = in_order
        self.transform = transform
        self.collate_fn = collate_fn
        self.ragged = dict(ragged) if isinstance(ragged, Mapping) else ragged
        self.read_mode: ReadMode = source.preferred_read_mode if read_mode == "auto" else read_mode
        self.request_size = request_size
        self.with_index = with_index
        self.on_error: OnError = on_error
        self.cpu_workers = cpu_workers
        self.loop: LoopKind = loop
        self.shutdown_timeout = shutdown_timeout
        self.sampler = EpochSampler(
            len(self.source), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
            remainder=remainder, shard=shard, start=start_batch,
        )  # fmt: skip
        if shard.world_size > 1 or shard_from != "no process group":
            log.info(
                "asyncload: %s reads rank %d of %d (from %s): %d batches per epoch",
                self.source.url, shard.rank, shard.world_size, shard_from, len(self.sampler),
            )  # fmt: skip
        self.epoch = 0
        self._live: Callable[[], EpochIterator | None] = lambda: None
        self._stats = Stats()
        self._progress = EpochProgress(0, len(self.sampler))  # of the live or last epoch
        self._resume: EpochProgress | None = None  # loaded by load_state_dict, used by the next iter()
        self._tuner: ConcurrencyTuner | None = None

    def __len__(self) -> int:
        """Batches per epoch for this loader's shard."""
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``iter()`` yields (reshuffles with ``shuffle=True``).

        A resume point loaded with ``load_state_dict`` survives only ``set_epoch`` of its own epoch, so
        a training loop can call ``set_epoch(epoch)`` unconditionally after loading a checkpoint.
        """
        _check("epoch", epoch, isinstance(epoch, int) and epoch >= 0, "an int >= 0")
        if self._resume is not None and self._resume.epoch != epoch:
            self._resume = None
        self.epoch = epoch

    # -- resume ----------------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        """What must match for a saved state to mean the same batches in this loader."""
        s = self.sampler
        return {
            "n": s.n, "batch_size": s.batch_size, "shuffle": s.shuffle, "seed": s.seed,
            "drop_last": s.drop_last, "remainder": s.remainder, "start": s.start,
            "shard": [s.shard.rank, s.shard.world_size, s.shard.worker, s.shard.num_workers],
            "dataset_version": self.source.version,
        }  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch stands: the epoch and the batches the consumer has taken.

        Save it with the model's checkpoint; ``load_state_dict`` makes the next ``iter()`` yield exactly
        the batches not yet taken (in the same order when ``in_order``). Batches read ahead but not
        taken are not in the state: they are read again after a resume, never lost or repeated.
        """
        progress = self._resume if self._resume is not None else self._progress
        if progress.epoch != self.epoch and self._live() is None:
            progress = EpochProgress(self.epoch, len(self.sampler))
        return progress.to_dict(self._fingerprint())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next ``iter()`` continues that epoch where it stood."""
        self._close_epoch()
        self._resume = EpochProgress.from_dict(state, self._fingerprint(), len(self.sampler), self.source.url)
        self.epoch = self._resume.epoch

    # -- epochs ----------------------------------------------------------------------------------
    def _plan(self, progress: EpochProgress) -> Plan:
        auto = self.concurrency == "auto"
        most = self.max_concurrency if auto else int(self.concurrency)
        if self.read_mode == "row":
            group = 1
        else:
            group = min(self.request_size or self.batch_size, self.batch_size, most)
        fetchers = max(1, most // group)
        tuner = None
        if auto:  # one tuner for the loader's life: a new epoch starts where the last one settled
            if self._tuner is None or (self._tuner.low, self._tuner.high) != (group, fetchers * group):
                self._tuner = ConcurrencyTuner(start=max(128, group), low=group, high=fetchers * group)
            tuner = self._tuner
        limit = max(1, tuner.limit // group) if tuner else fetchers
        self.source.configure(fetchers, fetchers * group)
        batches = [(seq, b) for seq, b in enumerate(self.sampler.batches(self.epoch)) if not progress.done(seq)]
        return Plan(
            self.source, batches, group, fetchers, limit, self.batch_size, self.prefetch, self.in_order,
            self.transform, self.collate_fn, self.with_index, self.on_error, tuner, self.log_every, self.hedge,
            ragged=self.ragged,
        )  # fmt: skip

    def __iter__(self) -> Iterator[Any]:
        """Start the current epoch (or its rest, after ``load_state_dict``). A loader runs one epoch at
        a time: a previous iterator of it is closed."""
        self._close_epoch()
        progress = self._resume if self._resume is not None else EpochProgress(self.epoch, len(self.sampler))
        self._resume = None
        if self.processes:
            from .fanout import WorkerPool  # imports this module

            if self._pool is None or self._pool.closed:  # the first epoch, or the last pool lost a worker
                self._pool = WorkerPool(
                    self.source, self._options, self.sampler.shard, self.processes, context=self.mp_context,
                    timeout=self.shutdown_timeout, sampler=self.sampler,
                )  # fmt: skip
            done = frozenset(j for j in range(len(self.sampler)) if progress.done(j))
            fan = self._pool.epoch(self.epoch, skip=done, in_order=self.in_order, progress=progress)
            self._live = weakref.ref(fan)  # type: ignore[assignment]
            self._stats = fan.stats
            self._progress = progress
            return fan
        it = EpochIterator(
            self._plan(progress), progress, loop=self.loop, cpu_workers=self.cpu_workers,
            shutdown_timeout=self.shutdown_timeout,
        )  # fmt: skip
        self._live = weakref.ref(it)
        self._stats = it.stats
        self._progress = progress
        return it

    def stats(self) -> dict[str, Any]:
        """Figures of the current (or last) epoch: throughput, reads in flight, latency percentiles,
        skipped samples (with ``skipped_samples``: the first of them, index and cause)."""
        snap = self._stats.snapshot()
        snap.update(
            concurrency_setting=self.concurrency, read_mode=self.read_mode, epoch=self.epoch,
            retries=self.source.retry_count(),
            skipped_samples=list(self._stats.skipped_samples),
        )  # fmt: skip
        return snap

    def close(self) -> None:
        """Stop the live epoch, if any (threads joined), and the worker processes of ``processes=K``.
        The loader stays usable: a later ``iter()`` starts new workers. Garbage collection of the loader
        and interpreter exit stop the workers too (``fanout.WorkerPool``)."""
        self._close_epoch()
        if self._pool is not None:
            self._pool.close()

    def _close_epoch(self) -> None:
        """Stop the live epoch, if any; with ``processes=K`` its workers stay, idle, for the next one."""
        it = self._live()
        if it is not None:
            it.close()

    def __enter__(self) -> AsyncLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"AsyncLoader({self.source!r}, batch_size={self.batch_size}, concurrency={self.concurrency}, "
            f"prefetch={self.prefetch}, read_mode={self.read_mode!r}, in_order={self.in_order})"
        )


__all__ = ["AsyncLoader", "EpochIterator", "AsyncLoadError"]
