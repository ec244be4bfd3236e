"""``ShardEpochs``: how one process reads its shard of a source, epoch after epoch.

The loader (``processes=0``) and every fan-out worker process read the same way: the sampler's plan for
an epoch, minus the batches already consumed, becomes a pipeline ``Plan`` (indices per request, fetcher
count, the requests allowed in flight) and an ``EpochIterator`` that owns that epoch's loop thread. The concurrency
tuner lives here, across epochs, so that a new epoch starts where the last one settled.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from ..image.decode import decode_stage
from ..sources.base import Source
from .blocks import BlockReads
from .epoch import EpochIterator
from .keeping import Keeping
from .mixing import mixed_order
from .options import LoaderOptions, ReadMode
from .plan import Plan
from .progress import EpochProgress
from .sampler import Ranges, Shard
from .tuning import ConcurrencyTuner

#: Samples in flight when a reader's first epoch starts with ``concurrency="auto"``. A first epoch on a
#: WAN is short next to the tuner's intervals (a few round trips each), so where it starts is most of what
#: a user gets in that epoch, so it starts high (the WAN runs that chose this value:
#: benchmarks/results/design_notes.md). Memory stays bounded by ``max_concurrency``.
TUNER_START = 256


class ShardEpochs:
    """Reads ``shard`` of an opened ``source`` with ``options``; one epoch at a time. ``worker``: in a
    fan-out worker process, which leaves GPU decoding, and the end-of-epoch skip report over every
    worker's figures, to the training process."""

    def __init__(self, source: Source[Any], options: LoaderOptions, shard: Shard, *, worker: bool = False) -> None:
        self.source = source
        self.options = o = options
        # A source that composes its own epochs (``MixedSource``) gives the sampler its order.
        self.sampler = o.sampler(len(source), shard, source.block_rows, mix=mixed_order(source))
        self._tuner: ConcurrencyTuner | None = None
        self._worker = worker
        self._stage = decode_stage(source, o)
        if worker and self._stage is not None and self._stage.device is not None:  # the GPU is the parent's
            self._stage = dataclasses.replace(self._stage, ship=True)
        self.read_mode: ReadMode = source.preferred_read_mode if o.read_mode == "auto" else o.read_mode
        # The node store's shelf, opened at the first plan (a shard opened only for its sampler holds
        # none) and released by ``close`` or garbage collection, so that an old version is never kept
        # on disk by a process that has stopped reading it.
        self._shelf: list[Keeping] = []
        weakref.finalize(self, _release, self._shelf)

    def _open_shelf(self) -> Keeping | None:
        """The shelf this shard's reads keep blocks on (None: not kept), opened (and held in use) on the
        first call after ``close``."""
        o = self.options
        if not self._shelf and o.wants_cache(self.source):
            got = Keeping.open(self.source, o.cache_dir, o.cache_bytes, asked=o.cache is True)
            if got is not None:
                self._shelf.append(got)
        return self._shelf[0] if self._shelf else None

    def close(self) -> None:
        """Release the shelf (a later epoch opens it again)."""
        _release(self._shelf)

    def plan(
        self, epoch: int, progress: EpochProgress, only: list[tuple[int, list[int]]] | None = None, taken: Ranges = ()
    ) -> Plan:
        """The pipeline's plan for ``epoch``: the shard's batches not yet consumed in ``progress``, or
        ``only`` these ``(seq, indices)`` (a fan-out reader reading a batch, or part of one, alone).
        ``taken``: the positions of the epoch's order an earlier run consumed (a resumed world)."""
        o = self.options
        auto = o.concurrency == "auto"
        most = o.max_concurrency if auto else int(o.concurrency)
        size = 1 if self.read_mode == "row" else min(o.request_size or o.batch_size, o.batch_size, most)
        fetchers = max(1, most // size)
        tuner = None
        if auto:  # one tuner for the reader's life: a new epoch starts where the last one settled
            if self._tuner is None or (self._tuner.low, self._tuner.high) != (size, fetchers * size):
                self._tuner = ConcurrencyTuner(start=max(TUNER_START, size), low=size, high=fetchers * size)
            tuner = self._tuner
        requests = max(1, tuner.samples // size) if tuner else fetchers
        self.source.configure(fetchers, fetchers * size)
        self.source.set_stall_timeout(o.stall_timeout)
        if only is None:
            sampler = dataclasses.replace(self.sampler, taken=taken) if taken else self.sampler
            batches = [(seq, b) for seq, b in enumerate(sampler.batches(epoch)) if not progress.done(seq)]
        else:
            batches = only
        stage = self._stage.for_epoch(epoch) if self._stage is not None else None
        block = self.sampler.block if self.sampler.shuffle and self.sampler.block > 1 else None
        reads = None
        shelf = self._open_shelf()
        if block is not None or shelf is not None:  # each block of the epoch's rows fetched once
            rows = (i for _, b in batches for i in b)
            hold = o.budget_bytes // 4  # rows read ahead in the heap, counted in the budget
            reads = BlockReads(
                self.source, block, rows, n=len(self.source), shelf=shelf, hold_limit=hold, window=o.shuffle_window,
                full=shelf is not None and shelf.full(),
            )  # fmt: skip
        return Plan(
            source=self.source, reads=reads, batches=batches, request_size=size, fetchers=fetchers, requests=requests,
            batch_size=o.batch_size, prefetch=o.prefetch, in_order=o.in_order, transform=o.transform,
            collate_fn=o.collate_fn, with_index=o.with_index, on_error=o.on_error, tuner=tuner,
            log_every=o.log_every, hedge=o.hedge, ragged=o.ragged, stage=stage, budget=o.budget_bytes,
            stall_timeout=o.stall_timeout,
        )  # fmt: skip

    def iterate(
        self, epoch: int, progress: EpochProgress, only: list[tuple[int, list[int]]] | None = None, taken: Ranges = ()
    ) -> EpochIterator:
        """An iterator over the rest of ``epoch``, or over ``only`` (see ``plan``); its loop thread starts on
        the first ``next()``."""
        o = self.options
        return EpochIterator(
            self.plan(epoch, progress, only, taken),
            progress,
            loop=o.loop,
            cpu_workers=o.cpu_pool,
            shutdown_timeout=o.shutdown_timeout,
            report_skips=not self._worker,
        )


__all__ = ["ShardEpochs"]


def _release(held: list[Keeping]) -> None:
    while held:
        held.pop().release()
