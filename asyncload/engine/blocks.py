"""``BlockReads``: the read stage. Each row of an epoch is fetched from the remote once, with its block,
and kept where it costs nothing until its batch comes: on the node's disk, or within the byte budget.

Why blocks: a store lays rows out in order and answers a read of one row with far more than the row (Deep
Lake 4.7.4 pulls ~130-260 KB of a chunk for a 20 KB JPEG), keeping the rest only briefly. On a dataset
larger than what it keeps, a full shuffle pulls 6-7x its bytes. The sampler's block order
(``sampler.block_order``) draws each batch from ~``window / block`` blocks of contiguous rows; this stage
reads a block's rows in one request when the first of them is due, so every stored byte crosses the
network about once.

Where the rows wait for their turn:

- **On the node block store** (``nodestore``, remote sources by default): a block is fetched by the
  first process of the node that needs it (a DataLoader worker, a fan-out process, a rank), whole, written
  to disk, and every process reads its rows from there when they come due, in this epoch and the later
  ones. The heap holds none of them.
- **In the heap, within the budget** (no store: local datasets, ``cache=False``, a store that is full or
  failed): a row read with its block is kept from the block's read to its batch, counted in
  ``stats.bytes_held`` and against ``memory_budget`` (the pipeline's budget admits fewer batches while
  rows are held). A block read starts only while what is held, and what the reads in flight will hold
  (their rows at the largest bytes per row seen), fits ``hold_limit``; past it the rows are read with
  their own batches, as a full shuffle reads them.

How blocks are cut into reads:

- **The start is read in parts**: the blocks that start the epoch all start together (so the first
  batches are as mixed as the rest), and read whole they would all be due at once. Their rows come in
  storage order over their spread, so such a block is read in parts as they come due, each a contiguous
  run: the rows due within ``max(ramp, p)`` positions of the part's first, ``p`` positions from the start
  of this reader's rows (the reach doubles; ``ramp``: ``RAMP_BLOCKS`` blocks' worth). With the node store
  a part is the whole run of storage from its first row to its last, other processes' rows in it too
  (their batches come as soon as this one's); the rest of the block is fetched by whichever process
  needs it next.
- **Any other block is read whole** — with the node store every row of it (the rows of other workers and
  ranks too, which they then find on disk); without it only the rows this epoch asks of this process.
- ``block=None`` (a full shuffle, or no shuffle): no read ahead; the rows of each request that are not on
  disk are fetched together and written down for the next epoch.

Failures stay with the rows that caused them: a block read that fails is not tried again as a block; the
reads waiting on it read their own rows alone, so a bad row fails (or is skipped) in its own request. A
hedge (``read_alone``) reads its rows alone too, rather than joining the straggling block read. A waiter
that is cancelled leaves a block read running (a Deep Lake read cannot be cancelled; the next ask for its
rows finds it), unless the store says its reads may be (``Source.cancel_safe``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable
from itertools import pairwise
from typing import Any

import numpy as np

from ..nodestore import CorruptPart, Entry, Unkeepable
from ..runtime.log import log_once
from ..runtime.loop import in_lane
from ..runtime.sizes import format_size
from ..sources.base import Columns, Source
from .budget import part_bytes
from .keeping import Claim, Const, Keeping
from .stats import Stats, wire_counter

#: The first part of a block read in parts reaches ``RAMP_BLOCKS * block`` positions (512 rows for Deep
#: Lake's 64): about what the pipeline asks for at once when an epoch starts (``shard.TUNER_START``, 256),
#: so the first batches wait for a few rows of each starting block, not for the blocks whole.
RAMP_BLOCKS = 8


class BlockReads:
    """Reads ``source`` for one epoch's ``rows`` (this process's, in order): in blocks of ``block`` rows
    (None: row by row), through ``shelf`` (the node store; None: none), holding at most ``hold_limit``
    bytes of rows read ahead in the heap. ``n``: the source's length (a block never reaches past it)."""

    def __init__(
        self,
        source: Source[Any],
        block: int | None,
        rows: Iterable[int],
        *,
        n: int,
        shelf: Keeping | None = None,
        hold_limit: int = 1 << 62,
        window: int = 0,
        ramp: int | None = None,
        full: bool = False,
    ) -> None:
        self.source = source
        self.block = block
        self.n = n
        rows = list(rows)
        self._mine = set(rows)  # the rows this epoch asks of this process (a miss is one of them)
        self._wire = wire_counter(source)  # the source counts its bytes received itself
        self.shelf = shelf
        self._disk = shelf  # what reads the rows found on disk (``shelf`` may turn None mid-epoch)
        self.hold_limit = hold_limit
        self.held_bytes = 0  # bytes of ``_held`` (counted in the budget)
        self._ahead = 0.0  # bytes the block reads in flight are expected to hold (``hold_limit`` counts them)
        self._row_bytes = 0.0  # bytes per row read so far (the largest mean of a read)
        self.window = window  # rows whose blocks are read ahead at once (the limit must hold half of them)
        self.stats = Stats()  # the pipeline's, once it ``attach``-es
        self.ramp = RAMP_BLOCKS * (block or 1) if ramp is None else ramp
        self._due: dict[int, list[int]] = {}  # part -> its rows this epoch asks for, not yet read
        self._whole: set[int] = set()  # parts that are a whole block (read with the block's other rows)
        self._part: dict[int, int] = {}  # row -> its part
        if block is not None:
            self._cut(block, rows)
        self._held: dict[int, tuple[dict[str, Any], int]] = {}  # row -> (value per column, bytes)
        self._reading: dict[int, asyncio.Task[None]] = {}  # part -> its read in flight
        self._fetched: set[int] = set()  # rows this stage fetched from the remote (not hits when read back)
        self._found: dict[int, dict[str, Entry | Const]] = {}  # row -> where it lies on the node store, per column
        # The store keeps no more (its limit reached for this node, or too small for half a window): rows
        # read ahead are then this process's only and held within ``hold_limit``, as without a store.
        self._full = full

    def _cut(self, block: int, rows: Iterable[int]) -> None:
        first: dict[int, int] = {}  # row -> its first position in this epoch's order
        for p, i in enumerate(rows):
            first.setdefault(int(i), p)
        runs: dict[int, list[tuple[int, int]]] = {}  # block -> (position, row), in position order
        for i, p in first.items():
            runs.setdefault(i // block, []).append((p, i))
        for run in runs.values():
            ordered = all(a < b for (_, a), (_, b) in pairwise(run))  # so each part is a contiguous run
            end = -1.0
            for p, i in run:
                if p >= end:  # a new part: the rows due within max(ramp, p) positions of this one
                    part = len(self._due)
                    end = p + max(self.ramp, p) if ordered else math.inf
                    self._due[part] = []
                    if end == math.inf:
                        self._whole.add(part)
                self._due[part].append(i)
                self._part[i] = part
        for due in self._due.values():
            due.sort()  # requested in storage order

    def attach(self, stats: Stats) -> None:
        """Count into the epoch's ``stats`` (the pipeline's)."""
        self.stats = stats

    # -- the stage's entry points ---------------------------------------------------------------------
    async def read(self, indices: list[int], raw: frozenset[str] = frozenset(), _tries: int = 2) -> Columns:
        """The values of ``indices``: from the node store, from rows held, from their blocks' reads (started
        here where none is in flight), or read alone. ``raw``: as ``Source.read``'s (the columns read as
        stored bytes), passed to every read of the source this starts."""
        if not indices:
            return await self.source.read(indices, raw)
        if self.shelf is not None and self.shelf.off:  # the disk or the index failed: no store from now on
            self.shelf = None
            self._found.clear()
        if self.shelf is not None:
            await self._look(indices, raw)
        ready = self._ready(indices)
        todo = [i for i in indices if i not in ready]
        # Again while it waited: a part that could not start (no room, or no row's size known yet) may have
        # been started by another request meanwhile, and a row read alone now would be read twice.
        while todo and self.block is not None and await self._wait_parts(todo, raw):
            ready = self._ready(indices)
            todo = [i for i in indices if i not in ready]
        fetched: dict[int, dict[str, Any]] = {}
        if todo and self.shelf is not None:  # rows-only reads (block None), or a part that failed or was cut
            # Read by this request from now on: a part read started while the fill is on the wire (room freed
            # meanwhile) must not fetch them again, and hold them for ever.
            self._undue(todo)
            fetched = await self._fill(todo, raw, keep=False, lock=False)  # (rows no other process asks for)
            todo = [i for i in todo if i not in fetched and i not in self._ready([i])]
        try:
            return await self._gather(indices, raw, todo, fetched)
        except CorruptPart as bad:  # dropped: its rows are fetched again (or, a second time, read alone)
            self._found = {
                r: e for r, e in self._found.items() if all(getattr(x, "part", None) != bad.part for x in e.values())
            }
            if self.shelf is not None:
                await in_lane(self.shelf.forget, bad.part)
            self.stats.node_corrupt += 1
            if _tries <= 0:
                return await self.read_alone(indices, raw)
            return await self.read(indices, raw, _tries - 1)

    async def read_alone(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        """``indices`` read from the source by themselves, past any block read in flight (a hedge)."""
        self._undue(indices)
        return await self.source.read(indices, raw)

    # -- where each row is ----------------------------------------------------------------------------
    async def _look(self, rows: list[int], raw: frozenset[str]) -> None:
        """Ask the node's index where the rows of ``rows`` not found yet lie (``raw``: as stored bytes), in one
        query: what any process of the node wrote so far."""
        shelf = self.shelf
        want = self._unfound(rows)
        if shelf is not None and want:
            self._found.update(await in_lane(shelf.lookup, want, raw))

    def _unfound(self, rows: list[int]) -> list[int]:
        """Of ``rows``, those neither held nor known on disk, once each: what to ask the index."""
        return list(dict.fromkeys(r for r in rows if r not in self._found and r not in self._held))

    def _ready(self, rows: list[int]) -> set[int]:
        """Of ``rows``, those held in the heap or on disk."""
        return {r for r in rows if r in self._held or r in self._found}

    async def _gather(
        self,
        indices: list[int],
        raw: frozenset[str],
        alone: list[int],
        fetched: dict[int, dict[str, Any]],
    ) -> Columns:
        """Assemble the answer: ``alone`` read now, ``fetched`` as it came, the rest from the heap or the disk
        (``CorruptPart`` before any held row is taken). Where the disk's rows lie is taken before any wait: a
        request running beside this one that finds a part corrupt drops that part's rows from ``_found``
        meanwhile (a row of it is then read back from the dropped file, which fails as corrupt and sends this
        request round again), and a row neither held nor found any more is read with ``alone``."""
        mine = set(alone) | set(fetched)
        lost = [i for i in dict.fromkeys(indices) if i not in mine and i not in self._held and i not in self._found]
        alone = alone + lost
        self._undue(alone)
        apos = {i: k for k, i in enumerate(alone)}
        disk = [i for i in indices if i not in self._held and i not in apos and i not in fetched]
        where = {c: [self._found[i][c] for i in disk] for c in self.source.columns} if disk else {}
        lone = await self.source.read(alone, raw) if alone else {}
        if alone:  # fetched from the source like any other (a miss where there is a store)
            self._count_fetch(alone, lone)
        got: dict[str, list[Any]] = {}
        if disk:
            got = await asyncio.to_thread(self._read_disk, where)
            self.stats.node_hits += sum(1 for i in disk if i not in self._fetched)
            self.stats.node_read_bytes += part_bytes(got)
        dpos = {i: k for k, i in enumerate(disk)}
        held: dict[int, dict[str, Any]] = {}
        for i in indices:  # (an index asked for twice in one request takes its held row once)
            if i not in apos and i not in dpos and i not in fetched and i not in held:
                row, nbytes = self._held.pop(i)
                self._release(nbytes)
                held[i] = row
        first = indices[0]
        names = (lone or got or fetched.get(first) or held.get(first) or dict.fromkeys(self.source.columns)).keys()
        out: dict[str, list[Any]] = {c: [] for c in names}
        for i in indices:
            for c in out:
                if i in apos:
                    out[c].append(lone[c][apos[i]])
                elif i in dpos:
                    out[c].append(got[c][dpos[i]])
                else:
                    out[c].append((fetched.get(i) or held[i])[c])
        return out  # type: ignore[return-value]

    def _read_disk(self, where: dict[str, list[Entry | Const]]) -> dict[str, list[Any]]:
        assert self._disk is not None
        return self._disk.get(where)

    def _undue(self, rows: list[int]) -> None:
        """``rows`` are read now by themselves: no part reads them again later (they would be held for ever)."""
        for i in rows:
            part = self._part.pop(i, None)
            due = self._due.get(part) if part is not None else None
            if due is not None and i in due:
                due.remove(i)

    # -- block reads ----------------------------------------------------------------------------------
    async def _wait_parts(self, todo: list[int], raw: frozenset[str]) -> bool:
        """Start (or join) the reads of the parts of ``todo`` and wait for them (False: there was none to
        wait for); a failed or cancelled one leaves its rows to be read alone."""
        parts = {self._part.get(i) for i in todo}
        waits = [t for t in (self._start(p, raw) for p in parts) if t is not None]
        if not waits:
            return False
        try:
            await asyncio.wait(waits)  # not gather: a cancelled waiter must not cancel a block's read...
        except asyncio.CancelledError:
            if self.source.cancel_safe:  # ...unless the store's reads may be cancelled
                for t in waits:  # (an epoch abandoned: nothing is left running past its loop)
                    t.cancel()
            raise
        for t in waits:
            if not t.cancelled():
                t.exception()  # retrieved: its rows' own reads raise what is wrong
        return True

    def _start(self, part: int | None, raw: frozenset[str]) -> asyncio.Task[None] | None:
        """The read of ``part``'s rows: the one in flight, a new one (reading ``raw`` as stored bytes), or
        None (nothing due, or no room to hold what it would read ahead)."""
        if part is None:
            return None
        task = self._reading.get(part)
        if task is None and self._due.get(part):
            ahead = len(self._due[part]) * self._row_bytes  # what it will hold (a guess until a row is read)
            busy = self.held_bytes + self._ahead
            unknown = not self._row_bytes and len(self._reading) >= RAMP_BLOCKS  # no row read yet: a few at once
            if (self.shelf is None or self._full) and (busy and busy + ahead > self.hold_limit or unknown):
                return None  # the heap is full: the rows come with their own batches
            self._ahead += ahead
            task = self._reading[part] = asyncio.ensure_future(self._read_part(part, ahead, raw))
        return task

    async def _read_part(self, part: int, ahead: float, raw: frozenset[str]) -> None:
        rows = self._due.pop(part)
        try:
            if self.shelf is None or self._full:  # this process's rows only, held until their batches
                rows = [r for r in rows if r not in self._found]  # (a full store's rows on disk stay there)
                if rows:
                    cols = await self.source.read(rows, raw)
                    self._count_fetch(rows, cols)
                    if self.shelf is not None and self.window and self.block is not None:  # (full from the start)
                        self._check_room(self.shelf, part_bytes(cols) / len(rows))
                    self._hold(rows, cols)
                    if self.shelf is not None:
                        self.stats.node_not_kept += len(rows)
                return
            if part in self._whole and self.block is not None:  # the block whole, for every process
                b = rows[0] // self.block
                whole = range(b * self.block, min((b + 1) * self.block, self.n))
                rows = sorted(set(rows) | set(self.shelf.valid(whole)))
            else:  # a part at the start: its run of storage, every process's rows in it (they are due as soon)
                rows = self.shelf.valid(range(rows[0], rows[-1] + 1))
            await self._fill(rows, raw, keep=True, lock=True)
        finally:
            del self._reading[part]
            self._ahead -= ahead

    async def _fill(self, rows: list[int], raw: frozenset[str], *, keep: bool, lock: bool) -> dict[int, dict[str, Any]]:
        """Fetch the rows of ``rows`` not on the node store (``raw`` as stored bytes) and write them there.
        ``lock``: once per node, under the node-wide claim of their bins, looking again at the index once it
        is held (a block read whole, whose rows every process asks for); else at once (rows only this
        process asks for this epoch: a claim would only queue unrelated reads behind each other). Returns
        the rows fetched (for a caller that asked for them now); where the store did not keep them and
        ``keep`` (rows read ahead for this epoch), those this epoch asks for are held in the heap."""
        shelf = self.shelf
        assert shelf is not None
        claim = await self._claim(shelf, rows, raw) if lock else None
        try:
            missing = [r for r in rows if r not in self._found]
            if not missing or (lock and claim is None):
                return {}
            got = await self.source.read(missing, raw)
            self._count_fetch(missing, got)
            if self.window and self.block is not None:  # (once, on the first fetch)
                self._check_room(shelf, part_bytes(got) / len(missing))
            kept = False
            if not self._full and self.shelf is not None:
                began = time.perf_counter()
                held, claim = claim, None  # (given back in the lane once the rows are in the index)
                try:
                    kept = await in_lane(_put, shelf, missing, got, raw, held)
                except Unkeepable as exc:
                    self._unkeepable(exc)
                else:
                    self.stats.store_write_s += time.perf_counter() - began
                    if kept:
                        if keep:  # written for the node; this process's rows also stay in the heap where they fit
                            self._hold_fetched(missing, got, bounded=True)
                        await self._look(missing, raw)
                    elif not shelf.off:
                        self._full = True  # the node's limit: what is on disk stays, the rest is read through
        finally:
            if claim:
                await in_lane(shelf.unclaim, claim)
        if not kept:
            self.stats.node_not_kept += len(missing)
            if keep:
                self._hold_fetched(missing, got, bounded=False)
        return {r: {c: v[k] for c, v in got.items()} for k, r in enumerate(missing)}

    async def _claim(self, shelf: Keeping, rows: list[int], raw: frozenset[str]) -> Claim | None:
        """The node-wide claim of the bins of ``rows`` before their fetch: held (the index looked at again:
        what another process wrote while this one waited), or None where the rows came meanwhile (another
        process fetched them). Polled every 5 ms, backing off to 100 ms; a claim whose holder died, or that
        is older than ``nodestore.CLAIM_PATIENCE_S``, is taken over (``Shelf.claim``)."""
        wait = 0.005
        while True:
            want = self._unfound(rows)
            claim, found = await in_lane(_claim_look, shelf, rows, want, raw)
            if claim is not None:
                self._found.update(found)
                return claim
            await asyncio.sleep(wait)
            wait = min(0.1, wait * 2)
            await self._look(rows, raw)
            if all(r in self._found for r in rows):
                return None

    def _check_room(self, shelf: Keeping, per_row: float) -> None:
        """A limit that cannot hold half of what one window keeps between its fetch and its turn would throw
        every fetch away: the store then reads through (this process's rows, held within the budget), said
        once."""
        half = self.window // 2
        self.window, need = 0, int(half * per_row)
        if shelf.room() < need:
            self._full = True
            shelf.quiet()  # (the one line said is this one: no "is kept in" before or after it)
            log_once(
                f"asyncload: cache_limit {format_size(shelf.limit)} cannot hold half a window of {self.source.url} "
                f"({half:,} rows): reading it through without keeping it; set cache_limit to at least "
                f"{format_size(_suggest(2 * need + shelf.limit - shelf.room()))}, a smaller shuffle_window, or cache=False",
                logging.WARNING,
                key=f"cache_limit too small {shelf.where} {self.source.url}",
            )

    def _unkeepable(self, exc: Unkeepable) -> None:
        """A column whose values the store cannot give back exactly: this source is read without the store
        (every column of a row comes from one place), said once."""
        self.shelf = None
        self._found.clear()
        log_once(
            f"asyncload: {self.source.url} is not kept on the node block store: {exc}; it is read from the store "
            f"every epoch (pass only the columns you need, or cache=False, to silence this)",
            logging.WARNING,
        )

    # -- the heap -------------------------------------------------------------------------------------
    def _hold_fetched(self, rows: list[int], cols: Columns, *, bounded: bool) -> None:
        """Of ``rows`` just fetched, hold those this epoch asks of this process (and not held already) in the
        heap. ``bounded``: the store kept them, so only as many as fit ``hold_limit``; their batches then take
        them from memory instead of reading them back from disk (an index query, a read and a checksum per
        value: on local disk that cost a first epoch with the store a third more time than one without,
        benchmarks/results/first_epoch/). Otherwise all of them: the store did not keep them, and a row let
        go here would be fetched again."""
        wanted = [r for r in rows if r in self._part and r not in self._held]
        if bounded and wanted:
            room = self.hold_limit - self.held_bytes - self._ahead
            per_row = max(1.0, part_bytes(cols) / len(rows))  # (rows of empty values take no room)
            wanted = wanted[: max(0, int(room // per_row))]
        if wanted:
            pos = {r: k for k, r in enumerate(rows)}
            self._hold(wanted, {c: [v[pos[r]] for r in wanted] for c, v in cols.items()})

    def _hold(self, rows: list[int], cols: Columns) -> None:
        st = self.stats
        for k, i in enumerate(rows):
            row = {c: _own(values[k]) for c, values in cols.items()}
            nbytes = part_bytes({c: [v] for c, v in row.items()})
            self._held[i] = (row, nbytes)
            self.held_bytes += nbytes
            st.bytes_held += nbytes
        st.bytes_held_peak = max(st.bytes_held_peak, st.bytes_held)

    def _release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes
        self.stats.bytes_held -= nbytes

    def _count_fetch(self, rows: list[int], cols: Columns) -> None:
        """``rows`` fetched from the source. A miss is a row this process asks for this epoch that the node
        store did not have, so that hits and misses add up to the rows it read: a block fetched whole
        brings the rows of other workers and ranks too, which are their hits, not this one's misses.
        ``remote_bytes`` counts them here unless the source counts its wire bytes (``wire_counter``)."""
        self._fetched.update(rows)
        nbytes = part_bytes(cols)
        if self.shelf is not None:  # (without the node store nothing is a miss: there is nothing to hit)
            self.stats.node_misses += sum(1 for r in rows if r in self._mine)
        if self._wire is None:
            self.stats.remote_bytes += nbytes
        if rows:
            self._row_bytes = max(self._row_bytes, nbytes / len(rows))


def _suggest(nbytes: float) -> int:
    """A limit to suggest for ``nbytes``: the next power of two of megabytes above it (1, 2, 4, ... MB), so
    that the figure a run says does not move with the sizes of the rows that happened to be read first."""
    return 1_000_000 << max(0, math.ceil(math.log2(max(nbytes, 1) / 1_000_000)))


def _claim_look(
    shelf: Keeping, rows: list[int], want: list[int], raw: frozenset[str]
) -> tuple[Claim | None, dict[int, dict[str, Entry | Const]]]:
    """The claim of ``rows``' bins and, where it is held, where the rows of ``want`` lie: one call on the lane
    (the index looked at once the claim is held, for what another process wrote meanwhile)."""
    claim = shelf.claim(rows)
    return claim, shelf.lookup(want, raw) if claim is not None and want else {}


def _put(shelf: Keeping, rows: list[int], got: Columns, raw: frozenset[str], claim: Claim | None) -> bool:
    """``Keeping.put``, then the claim given back whatever came of it: one call on the lane, the claim held
    until the rows are in the index (or their write failed)."""
    try:
        return shelf.put(rows, got, raw)
    finally:
        if claim:
            shelf.unclaim(claim)


def _own(value: Any) -> Any:
    """``value`` in memory of its own: a reader process's answer arrives as views into one buffer per
    answer (a block's ~2 MB), and one held row that is a view keeps all of it alive until that row is asked
    for; a row's bytes copied out cost a memcpy (~32 KB) and let the rest go with the rows asked now."""
    if isinstance(value, memoryview):
        return value.tobytes()
    if isinstance(value, np.ndarray) and value.base is not None:
        return value.copy()
    return value


__all__ = ["BlockReads", "RAMP_BLOCKS"]
