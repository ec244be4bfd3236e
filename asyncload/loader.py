"""``AsyncLoader``: coroutine fetchers on a background loop, a bounded ready queue, exact epochs.

One epoch, as it runs::

    sampler ─▶ producer ──(batch slot)──▶ work queue ─▶ N fetchers ─await source.read─▶ parts
                  ▲                                                                       │
                  └──── slot released when the consumer takes a batch ◀── ready queue ◀── assemble (CPU pool)

- **Bounded memory.** A batch takes a *slot* before its reads are issued and gives it back only when the
  consumer takes it, so batches in flight + assembling + waiting for order + ready never exceed
  ``prefetch + ceil(concurrency / batch_size) + 1``. Samples in flight never exceed ``concurrency``.
  The producer waits for a slot by awaiting on the loop; nothing on the loop thread blocks.
- **No spinning.** The consumer blocks on a thread-safe queue (waking once a second only to notice a dead
  loop thread); the loop thread sleeps in the selector until a read completes.
- **Exact epochs.** Each index of the shard's plan is issued once; a batch is delivered once, in sampler
  order through a reorder buffer (``in_order=True``) or as it completes.
- **Lifetimes.** The loop thread lives for one epoch's iterator: it stops and is joined when the epoch
  ends, on ``break`` (iterator close or garbage collection), on an error, and at interpreter exit. On a
  stop no new read is issued and the reads in flight are awaited (never cancelled: a cancelled Deep Lake
  future hangs forever), bounded by ``shutdown_timeout``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import os
import queue
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from ._loop import LoopKind, LoopThread
from .collate import CollateFn, Transform, collate_columns, default_collate, rows
from .errors import AsyncLoadError, ConfigError, ReadError, WorkerError, read_error
from .sampler import EpochSampler, Remainder, Shard
from .sources.base import Source
from .stats import Stats

log = logging.getLogger("asyncload")

ReadMode = Literal["auto", "row", "column"]

_END = object()


@dataclass
class _Failure:
    exc: BaseException


@dataclass
class _Batch:
    seq: int
    indices: list[int]
    pending: int
    parts: dict[int, Any] = field(default_factory=dict)
    failed: bool = False


@dataclass(frozen=True)
class _Plan:
    """Everything an epoch's pipeline needs, fixed at ``iter()`` time."""

    source: Source[Any]
    batches: list[list[int]]
    group: int
    fetchers: int
    slots: int
    in_order: bool
    transform: Transform | None
    collate_fn: CollateFn | None
    with_index: bool


def _check(name: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} is not allowed: {allowed}")


class _Pipeline:
    """The coroutines of one epoch. Everything here runs on the loop thread."""

    def __init__(self, plan: _Plan, out: queue.SimpleQueue[Any], lt: LoopThread, stats: Stats) -> None:
        self.plan = plan
        self.out = out
        self.lt = lt
        self.stats = stats
        self.stopping = False
        self._next_seq = 0
        self._reorder: dict[int, Any] = {}
        self._assembling: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        plan = self.plan
        self._slots = asyncio.Semaphore(plan.slots)
        self._work: asyncio.Queue[tuple[_Batch, int, int] | None] = asyncio.Queue()
        fetchers = [asyncio.create_task(self._fetch()) for _ in range(plan.fetchers)]
        for seq, indices in enumerate(plan.batches):
            await self._slots.acquire()
            if self.stopping:
                break
            starts = range(0, len(indices), plan.group)
            batch = _Batch(seq, indices, pending=len(starts))
            for s in starts:
                self._work.put_nowait((batch, s, min(s + plan.group, len(indices))))
        for _ in fetchers:
            self._work.put_nowait(None)
        await asyncio.gather(*fetchers)
        while self._assembling:
            await asyncio.gather(*list(self._assembling))
        if not self.stopping:
            self.out.put(_END)

    # -- called from the consumer thread through LoopThread.call_soon --------------------------
    def release_slot(self) -> None:
        self._slots.release()

    def stop(self) -> None:
        """Issue no more reads; let the ones in flight finish; wake the producer so it can exit."""
        if self.stopping:
            return
        self.stopping = True
        while not self._work.empty():
            self._work.get_nowait()
        self._slots.release()

    # -- fetch, assemble, deliver ----------------------------------------------------------------
    async def _fetch(self) -> None:
        source, stats = self.plan.source, self.stats
        while (item := await self._work.get()) is not None:
            batch, start, end = item
            if batch.failed or self.stopping:
                continue
            idx = batch.indices[start:end]
            stats.requests += 1
            stats.in_flight += len(idx)
            t0 = time.perf_counter()
            try:
                part = await source.read(idx)
            except Exception as exc:  # noqa: BLE001 - delivered to the consumer
                err = exc if isinstance(exc, ReadError) else read_error(source.url, None, idx, exc)
                self._fail(batch, err)
                continue
            finally:
                stats.in_flight -= len(idx)
            stats.latencies.append(time.perf_counter() - t0)
            stats.samples_read += len(idx)
            batch.parts[start] = part
            batch.pending -= 1
            if batch.pending == 0 and not self.stopping:
                task = asyncio.create_task(self._finish(batch))
                self._assembling.add(task)
                task.add_done_callback(self._assembling.discard)

    async def _finish(self, batch: _Batch) -> None:
        try:
            out = await self.lt.run_cpu(self._assemble, batch)
        except Exception as exc:  # noqa: BLE001 - delivered to the consumer
            exc.add_note(f"asyncload: while assembling the batch of indices {batch.indices[:16]} from {self.plan.source.url}")
            self._fail(batch, exc)
            return
        self._deliver(batch.seq, (len(batch.indices), out))

    def _assemble(self, batch: _Batch) -> Any:
        """On the CPU pool: parts in position order → transform → collate."""
        plan = self.plan
        parts = [batch.parts[s] for s in sorted(batch.parts)]
        cols = plan.source.columns
        if plan.transform is None and plan.collate_fn is None:
            return collate_columns(cols, parts, batch.indices, plan.with_index)
        samples: list[Any] = rows(cols, parts, batch.indices)
        if plan.transform is not None:
            out = []
            for s in samples:
                t = plan.transform(s)
                if plan.with_index and isinstance(t, dict) and "index" not in t:
                    t["index"] = s["index"]
                out.append(t)
            samples = out
        elif not plan.with_index:
            for s in samples:
                del s["index"]
        return (plan.collate_fn or default_collate)(samples)

    def _fail(self, batch: _Batch, exc: BaseException) -> None:
        if batch.failed:
            return
        batch.failed = True
        self._deliver(batch.seq, _Failure(exc))

    def _deliver(self, seq: int, item: Any) -> None:
        self.stats.batches_ready += 1
        if not self.plan.in_order:
            self.out.put(item)
            return
        self._reorder[seq] = item
        while self._next_seq in self._reorder:
            self.out.put(self._reorder.pop(self._next_seq))
            self._next_seq += 1


class EpochIterator(Iterator[Any]):
    """Iterates one epoch. Owns the loop thread of that epoch; ``close()`` (or ``del``) stops it.

    Use it as a context manager, or rely on ``break`` + garbage collection; both stop every thread.
    """

    def __init__(self, plan: _Plan, *, loop: LoopKind, cpu_workers: int, shutdown_timeout: float) -> None:
        self._plan = plan
        self._timeout = shutdown_timeout
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.stats = Stats()
        self._lt = LoopThread(loop=loop, cpu_workers=cpu_workers, owner_close=self.close)
        self._pipeline = _Pipeline(plan, self._out, self._lt, self.stats)
        self._future: concurrent.futures.Future[None] | None = None
        self._closed = False

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
        t0 = time.perf_counter()
        while True:
            try:
                item = self._out.get(timeout=1.0)
                break
            except queue.Empty:
                if self._future.done() or not self._lt.running:
                    self._die()
        waited = time.perf_counter() - t0
        st = self.stats
        st.wait_s += waited
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            raise item.exc
        self._lt.call_soon(self._pipeline.release_slot)
        count, batch = item
        st.batches_yielded += 1
        st.samples_yielded += count
        if st.first_batch_s is None:
            st.first_batch_s = time.perf_counter() - st.started
        return batch

    def _die(self) -> None:
        """The pipeline ended without saying so: report why instead of waiting forever."""
        cause: BaseException | None = None
        if self._future is not None and self._future.done() and not self._future.cancelled():
            cause = self._future.exception()
        self.close()
        raise WorkerError(f"asyncload's loop thread for {self._plan.source.url} ended unexpectedly") from cause

    def close(self) -> None:
        """Stop issuing reads, wait (bounded) for those in flight, stop and join the loop thread."""
        if self._closed:
            return
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
        self._lt.stop(self._timeout)

    def __enter__(self) -> EpochIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass



class AsyncLoader:
    """Batches from a ``Source``, read by coroutines on a background event loop.

    Parameters that matter most:
      concurrency   samples being read at once (hundreds are fine for remote stores)
      prefetch      ready batches kept ahead of the consumer
      read_mode     "column": one request per column for a group of ``request_size`` indices;
                    "row": one request per sample and column; "auto" (default): what the source
                    measured faster (``Source.preferred_read_mode``)
      request_size  indices per column request in "column" mode (default: the batch size)
      in_order      True: batches in sampler order (reorder buffer); False: as they complete
      shuffle, seed the order of an epoch; ``set_epoch(e)`` selects the epoch (like DistributedSampler)
      shard         which rank/worker share of each epoch this loader serves
      remainder     "pad" or "drop" when ranks do not divide the dataset (see ``sampler``)
      transform     per-sample callable on ``{column: array, "index": int}`` (arrays are read-only views)
      collate_fn    turns the list of (transformed) samples into a batch
      with_index    add an ``"index"`` int64 tensor of dataset indices to default batches
    """

    def __init__(
        self,
        source: Source[Any],
        batch_size: int = 32,
        *,
        shuffle: bool = False,
        seed: int = 0,
        concurrency: int = 64,
        prefetch: int = 4,
        in_order: bool = True,
        drop_last: bool = False,
        transform: Transform | None = None,
        collate_fn: CollateFn | None = None,
        read_mode: ReadMode = "auto",
        request_size: int | None = None,
        with_index: bool = True,
        remainder: Remainder = "pad",
        shard: Shard | None = None,
        cpu_workers: int | None = None,
        loop: LoopKind = "auto",
        shutdown_timeout: float = 10.0,
    ) -> None:
        if not isinstance(source, Source):
            raise ConfigError(f"source={source!r} is not allowed: pass a Source such as DeepLakeSource(url)")
        _check("batch_size", batch_size, isinstance(batch_size, int) and batch_size >= 1, "an int >= 1")
        _check("concurrency", concurrency, isinstance(concurrency, int) and concurrency >= 1, "an int >= 1")
        _check("prefetch", prefetch, isinstance(prefetch, int) and prefetch >= 1, "an int >= 1")
        _check("read_mode", read_mode, read_mode in ("auto", "row", "column"), "'auto', 'row' or 'column'")
        _check("request_size", request_size, request_size is None or (isinstance(request_size, int) and request_size >= 1), "None or an int >= 1")
        _check("remainder", remainder, remainder in ("pad", "drop"), "'pad' or 'drop'")
        _check("loop", loop, loop in ("auto", "uvloop", "asyncio"), "'auto', 'uvloop' or 'asyncio'")
        _check("shutdown_timeout", shutdown_timeout, shutdown_timeout > 0, "a number of seconds > 0")
        for name, fn in (("transform", transform), ("collate_fn", collate_fn)):
            _check(name, fn, fn is None or callable(fn), "None or a callable")
        if cpu_workers is None:
            cpu_workers = min(4, os.cpu_count() or 1)
        _check("cpu_workers", cpu_workers, isinstance(cpu_workers, int) and cpu_workers >= 1, "an int >= 1")
        if with_index and "index" in source.columns:
            raise ConfigError("with_index=True is not allowed with a column named 'index': pass with_index=False")
        self.source = source.open()
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.prefetch = prefetch
        self.in_order = in_order
        self.transform = transform
        self.collate_fn = collate_fn
        self.read_mode: ReadMode = source.preferred_read_mode if read_mode == "auto" else read_mode
        self.request_size = request_size
        self.with_index = with_index
        self.cpu_workers = cpu_workers
        self.loop: LoopKind = loop
        self.shutdown_timeout = shutdown_timeout
        self.sampler = EpochSampler(
            len(self.source), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
            remainder=remainder, shard=shard or Shard(),
        )  # fmt: skip
        self.epoch = 0
        self._live: Callable[[], EpochIterator | None] = lambda: None
        self._stats = Stats()

    def __len__(self) -> int:
        """Batches per epoch for this loader's shard."""
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``iter()`` yields (reshuffles with ``shuffle=True``)."""
        _check("epoch", epoch, isinstance(epoch, int) and epoch >= 0, "an int >= 0")
        self.epoch = epoch

    def _plan(self) -> _Plan:
        if self.read_mode == "row":
            group = 1
        else:
            group = min(self.request_size or self.batch_size, self.batch_size, self.concurrency)
        fetchers = max(1, self.concurrency // group)
        slots = self.prefetch + math.ceil(self.concurrency / self.batch_size) + 1
        self.source.configure(fetchers)
        return _Plan(
            self.source, self.sampler.batches(self.epoch), group, fetchers, slots, self.in_order,
            self.transform, self.collate_fn, self.with_index,
        )  # fmt: skip

    def __iter__(self) -> EpochIterator:
        """Start the current epoch. A loader runs one epoch at a time: a previous iterator is closed."""
        self.close()
        it = EpochIterator(self._plan(), loop=self.loop, cpu_workers=self.cpu_workers, shutdown_timeout=self.shutdown_timeout)
        self._live = weakref.ref(it)
        self._stats = it.stats
        return it

    def stats(self) -> dict[str, Any]:
        """Figures of the current (or last) epoch: throughput, reads in flight, latency percentiles."""
        snap = self._stats.snapshot()
        snap.update(concurrency=self.concurrency, read_mode=self.read_mode, epoch=self.epoch)
        return snap

    def close(self) -> None:
        """Stop the live epoch, if any (threads joined)."""
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
