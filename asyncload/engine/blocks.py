"""``BlockReads``: a shuffled epoch's rows read a block at a time, each block once.

Why: a store lays rows out in order and answers a read of one row with far more than the row (Deep
Lake 4.7.4 pulls ~130-260 KB of a chunk for a 20 KB JPEG), keeping the rest only briefly. On a dataset
larger than what it keeps, a full shuffle pulls 6-7x its bytes. The sampler's block order
(``sampler.block_order``) draws each batch from ~``window / block`` blocks of contiguous rows; this layer
reads each block's rows of the epoch in one request when the first of them is asked for, and hands the
rest out as their batches ask, so every stored byte crosses the network about once.

- **What is held is bounded by the order**: a row is kept from its block's read until its own batch
  reads it, then dropped; the block order puts every row of a block within ~``window`` positions of its
  first, so about half a window of rows is held at any time, steadily.
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
from collections.abc import Iterable
from typing import Any

from ..sources.base import Columns, Source


class BlockReads:
    """``source`` read in blocks of ``block`` contiguous rows, for the rows in ``rows`` (this epoch's)."""

    def __init__(self, source: Source[Any], block: int, rows: Iterable[int]) -> None:
        self._source = source
        self.block = block
        self._due: dict[int, list[int]] = {}  # block -> its rows this epoch asks for, not yet read
        for i in sorted(set(rows)):
            self._due.setdefault(i // block, []).append(i)
        self._held: dict[int, dict[str, Any]] = {}  # row -> its value per column, read and not yet asked for
        self._reading: dict[int, asyncio.Task[None]] = {}  # block -> its read in flight

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)

    async def read(self, indices: list[int]) -> Columns:
        """The values of ``indices``, from their blocks' reads where those are due or held."""
        if not indices:
            return await self._source.read(indices)
        waits = [self._start(b) for b in {i // self.block for i in indices if i not in self._held}]
        waits = [t for t in waits if t is not None]
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

    def _start(self, b: int) -> asyncio.Task[None] | None:
        """The read of block ``b``'s due rows: the one in flight, a new one, or None (nothing due)."""
        task = self._reading.get(b)
        if task is None and b in self._due:
            task = self._reading[b] = asyncio.ensure_future(self._read_block(b))
        return task

    async def _read_block(self, b: int) -> None:
        rows = self._due.pop(b)
        try:
            cols = await self._source.read(rows)
        finally:
            del self._reading[b]
        for k, i in enumerate(rows):
            self._held[i] = {c: values[k] for c, values in cols.items()}


__all__ = ["BlockReads"]
