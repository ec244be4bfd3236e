"""``BlockReads``: a shuffled epoch's rows read a block at a time, each row once.

Why: a store lays rows out in order and answers a read of one row with far more than the row (Deep
Lake 4.7.4 pulls ~130-260 KB of a chunk for a 20 KB JPEG), keeping the rest only briefly. On a dataset
larger than what it keeps, a full shuffle pulls 6-7x its bytes. The sampler's block order
(``sampler.block_order``) draws each batch from ~``window / block`` blocks of contiguous rows; this layer
reads each block's rows of the epoch in one request when the first of them is asked for, and hands the
rest out as their batches ask, so every stored byte crosses the network about once.

- **What is held is bounded by the order**: a row is kept from its block's read until its own batch
  reads it, then dropped; the block order puts every row of a block within ~``window`` positions of its
  first, so about half a window of rows is held at any time, steadily. A held row is a copy of its own
  (``_own``): a reader process answers with views into one buffer per answer, and one held view would
  keep its whole block's buffer alive until that row's batch.
- **The start is read in parts**: the blocks that start the epoch all start together (so that the first
  batches are as mixed as the rest), and read whole they would all be due at once: a window of rows
  fetched and held before the first batch. Their rows come in storage order over their spread, so a
  block whose rows are due in storage order is read in parts as they come due, each a contiguous run (a
  read costs about its rows): the rows due within ``max(ramp, p)`` positions of the part's first, ``p``
  positions from the start of this reader's rows, so the reach doubles (``ramp``: ``RAMP_BLOCKS``
  blocks' worth). Any other block is read whole.
- **Only the rows this epoch asks for** are read with a block (a resumed epoch's consumed batches, another
  worker's batches, stay out), each once. A row asked for again (a retry, a hedge, a re-read of a failed
  request) that is no longer held is read alone, as it would be without this layer.
- **Failures stay with the rows that caused them**: a block read that fails is not tried again as a block;
  the reads waiting on it read their own rows alone, so a bad row fails (or is skipped, with
  ``on_error="skip"``) in its own request, named as it would be without this layer.
- A waiter that is cancelled leaves the block read running (a Deep Lake read cannot be cancelled; the
  next ask for its rows finds it), unless the store says its reads may be (``Source.cancel_safe``).

Everything else (the URL, columns, stats hooks) is the wrapped source's.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

import numpy as np

from ..sources.base import Columns, Source

#: The first part of a block read in parts reaches ``RAMP_BLOCKS * block`` positions (512 rows for Deep
#: Lake's 64): about what the pipeline asks for at once when an epoch starts (``shard.TUNER_START``, 256),
#: so the first batches wait for a few rows of each starting block, not for the blocks whole.
RAMP_BLOCKS = 8


class BlockReads:
    """``source`` read in blocks of ``block`` contiguous rows, for the rows in ``rows`` (this epoch's)."""

    def __init__(self, source: Source[Any], block: int, rows: Iterable[int], ramp: int | None = None) -> None:
        self._source = source
        self.block = block
        self.ramp = RAMP_BLOCKS * block if ramp is None else ramp
        first: dict[int, int] = {}  # row -> its first position in this epoch's order
        for p, i in enumerate(rows):
            first.setdefault(int(i), p)
        runs: dict[int, list[tuple[int, int]]] = {}  # block -> (position, row), in position order
        for i, p in first.items():
            runs.setdefault(i // block, []).append((p, i))
        self._due: dict[int, list[int]] = {}  # part -> its rows this epoch asks for, not yet read
        self._part: dict[int, int] = {}  # row -> its part
        for run in runs.values():
            ordered = all(a < b for (_, a), (_, b) in pairwise(run))  # so each part is a contiguous run
            end = -1.0
            for p, i in run:
                if p >= end:  # a new part: the rows due within max(ramp, p) positions of this one
                    part = len(self._due)
                    end = p + max(self.ramp, p) if ordered else math.inf
                    self._due[part] = []
                self._due[part].append(i)
                self._part[i] = part
        for due in self._due.values():
            due.sort()  # requested in storage order
        self._held: dict[int, dict[str, Any]] = {}  # row -> its value per column, read and not yet asked for
        self._reading: dict[int, asyncio.Task[None]] = {}  # part -> its read in flight

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    async def read(self, indices: list[int]) -> Columns:
        """The values of ``indices``, from their blocks' reads where those are due or held."""
        if not indices:
            return await self._source.read(indices)
        parts = {self._part.get(i) for i in indices if i not in self._held}
        waits = [t for t in map(self._start, parts) if t is not None]
        if waits:  # a failed block leaves its rows unheld: they are read alone below
            try:
                await asyncio.wait(waits)  # not gather: a cancelled waiter must not cancel a block's read...
            except asyncio.CancelledError:
                if self._source.cancel_safe:  # ...unless the store's reads may be cancelled
                    for t in waits:  # (an epoch abandoned: nothing is left running past its loop)
                        t.cancel()
                raise
            for t in waits:
                if not t.cancelled():
                    t.exception()  # retrieved: its rows' own reads below raise what is wrong
        alone = [i for i in indices if i not in self._held]
        lone = await self._source.read(alone) if alone else {}
        pos = {i: k for k, i in enumerate(alone)}
        out: dict[str, list[Any]] = {c: [] for c in (lone or self._held[indices[0]])}
        for i in indices:
            if i in pos:
                for c, values in lone.items():
                    out[c].append(values[pos[i]])
            else:
                row = self._held.pop(i)
                for c in out:
                    out[c].append(row[c])
        return out  # type: ignore[return-value]

    def _start(self, part: int | None) -> asyncio.Task[None] | None:
        """The read of ``part``'s rows: the one in flight, a new one, or None (nothing due)."""
        if part is None:
            return None
        task = self._reading.get(part)
        if task is None and part in self._due:
            task = self._reading[part] = asyncio.ensure_future(self._read_part(part))
        return task

    async def _read_part(self, part: int) -> None:
        rows = self._due.pop(part)
        try:
            cols = await self._source.read(rows)
        finally:
            del self._reading[part]
        for k, i in enumerate(rows):
            self._held[i] = {c: _own(values[k]) for c, values in cols.items()}


def _own(value: Any) -> Any:
    """``value`` in memory of its own: a reader process's answer arrives as views into one buffer per
    answer (a block's ~2 MB), and one held row that is a view keeps all of it alive until that row is asked
    for; a row's bytes copied out cost a memcpy (~32 KB) and let the rest go with the rows asked now."""
    if isinstance(value, memoryview):
        return value.tobytes()
    if isinstance(value, np.ndarray) and value.base is not None:
        return value.copy()
    return value


__all__ = ["BlockReads"]
