"""Shuffled epochs read in blocks (``blocks.BlockReads`` over ``sampler.block_order``): each block of the
epoch's rows read once, in one request, every row yielded once, resumable, bounded, and a bad row still
named alone. The loaders read through the default reader process (reads are logged to a file by
``RecordingSource``): in-process Deep Lake reads of abandoned epochs can crash the process (the cores in
docs/ARCHITECTURE.md's crash table came from this module when it read in-process)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource, EpochSampler, ReadError
from asyncload.engine.blocks import BlockReads

from .conftest import ROWS, WORKER_START
from .resume import check_resume, ids
from .sources import FailingSource, RecordingSource

pytestmark = pytest.mark.timeout(180)

BLOCK, WINDOW = 8, 32  # 203 rows: 26 blocks, each batch drawn from ~4 of them
OPTS = {"shuffle": True, "shuffle_block": BLOCK, "shuffle_window": WINDOW}


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


def test_each_block_of_the_epoch_is_read_once_in_one_request(seg_url, tmp_path) -> None:
    src = RecordingSource(seg_url, tmp_path / "reads.jsonl")
    loader = AsyncLoader(src, batch_size=16, seed=3, **OPTS)
    got = ids(list(loader))
    assert got == EpochSampler(ROWS, 16, shuffle=True, seed=3, block=BLOCK, window=WINDOW).batches(0)
    assert Counter(flat(got)) == Counter(range(ROWS))
    assert sorted(map(tuple, src.reads)) == [tuple(range(b, min(b + BLOCK, ROWS))) for b in range(0, ROWS, BLOCK)]


def test_the_first_blocks_are_read_in_parts_as_they_come_due(seg_url, tmp_path) -> None:
    """The blocks that start the epoch, in storage order over their spread, are read in parts as their
    rows come due (each a contiguous run, reaching twice as far each time), not all at once at the start;
    every other block in one request; every row once."""
    block, window = 8, 64  # 8 of 26 blocks start the epoch; RAMP_BLOCKS * 8 = 64 positions in first parts
    src = RecordingSource(seg_url, tmp_path / "reads.jsonl")
    loader = AsyncLoader(src, batch_size=16, seed=3, shuffle=True, shuffle_block=block, shuffle_window=window)
    got = ids(list(loader))
    assert got == EpochSampler(ROWS, 16, shuffle=True, seed=3, block=block, window=window).batches(0)
    assert Counter(flat(src.reads)) == Counter(range(ROWS))  # each row read once
    assert all(r == list(range(r[0], r[0] + len(r))) for r in src.reads)  # each read a contiguous run
    reads_per_block = Counter(r[0] // block for r in src.reads)
    assert sum(1 for k in reads_per_block.values() if k > 1) >= window // block // 2
    assert len(src.reads) < 2 * -(-ROWS // block)


def test_rows_held_for_later_batches_are_copied_out_of_the_answer() -> None:
    """A reader process answers with views into one buffer per answer: a held row keeps its own bytes,
    not the block's buffer (which goes with the rows asked for now)."""

    class Views:
        cancel_safe = True

        async def read(self, indices, raw=frozenset()):
            buf = bytearray(b"".join(bytes([i]) * 4 for i in indices))
            return {"x": [memoryview(buf)[4 * k : 4 * k + 4] for k in range(len(indices))]}

    async def go():
        reads = BlockReads(Views(), 4, [0, 5, 1, 2, 3, 4, 6, 7], n=8)
        first = await reads.read([0])
        assert bytes(first["x"][0]) == b"\0" * 4
        assert all(type(v["x"]) is bytes for v, _ in reads._held.values())  # noqa: SLF001 - what is held
        rest = await reads.read([1, 2, 3, 5])
        assert [bytes(v) for v in rest["x"]] == [bytes([i]) * 4 for i in (1, 2, 3, 5)]

    asyncio.run(go())


def test_a_hedge_reads_its_rows_alone_past_a_stuck_block_read() -> None:
    """A block read that hangs holds every row of its block; a hedge (``read_alone``) must not join it, or
    hedging does nothing under the block order: it reads its own rows by themselves and answers, and the
    rows it took are not read again (or held for ever) when the block read ends."""
    release = asyncio.Event()

    class StuckBlocks:
        cancel_safe = True
        columns = ("x",)
        calls: list[list[int]] = []

        async def read(self, indices, raw=frozenset()):
            self.calls.append(list(indices))
            if len(indices) > 1:  # the block read: stuck until released
                await release.wait()
            return {"x": [bytes([i]) for i in indices]}

    async def go():
        src = StuckBlocks()
        reads = BlockReads(src, 4, [3, 2, 1, 0, 7, 6, 5, 4], n=8)  # (not in storage order: whole blocks)
        stuck = asyncio.ensure_future(reads.read([0]))
        await asyncio.sleep(0.05)
        assert not stuck.done() and src.calls == [[0, 1, 2, 3]]
        hedge = await asyncio.wait_for(reads.read_alone([0]), timeout=5)
        assert hedge == {"x": [b"\0"]} and src.calls[-1] == [0]
        release.set()
        assert (await stuck) == {"x": [b"\0"]}
        rest = await reads.read([1, 2, 3])
        assert rest == {"x": [b"\1", b"\2", b"\3"]} and len(src.calls) == 2  # held, not read again
        assert not reads._held  # noqa: SLF001 - nothing left behind

    asyncio.run(go())


def test_rows_a_request_fetches_itself_are_not_read_again_by_a_block_read_started_meanwhile() -> None:
    """A request whose block read found no room fetches its rows itself (through the node store's fill); a
    request that starts that block's read while the fetch is on the wire (room freed meanwhile) must not
    read those rows too: they would be fetched twice and held for ever (no batch asks for them again),
    their bytes counted against the hold limit to the epoch's end."""
    gate = asyncio.Event()

    class Gated:
        cancel_safe = True
        columns = ("x",)
        url = "gated://x"
        calls: list[list[int]] = []

        async def read(self, indices, raw=frozenset()):
            self.calls.append(list(indices))
            if indices == [0]:  # the request's own fetch: on the wire until released
                await gate.wait()
            return {"x": [bytes([i]) * 100 for i in indices]}

    class FullStore:  # the node store, full: nothing found, nothing kept
        off = False

        def lookup(self, want, raw):
            return {}

    async def go():
        src = Gated()
        reads = BlockReads(src, 4, [7, 6, 5, 4, 3, 2, 1, 0], n=8, shelf=FullStore(), hold_limit=400, full=True)
        assert (await reads.read([7]))["x"] == [bytes([7]) * 100]  # block 1 read whole: 6, 5, 4 held (300 B)
        own = asyncio.ensure_future(reads.read([0]))  # block 0 would hold 400 B more: no room, fetched alone
        while src.calls[-1] != [0]:
            await asyncio.sleep(0.01)
        await reads.read([6, 5, 4])  # room again
        assert (await reads.read([1]))["x"] == [b"\1" * 100]  # block 0 read now, without row 0
        gate.set()
        assert (await own)["x"] == [b"\0" * 100]
        assert (await reads.read([3, 2]))["x"] == [b"\3" * 100, b"\2" * 100]
        assert sorted(sorted(c) for c in src.calls) == [[0], [1, 2, 3], [4, 5, 6, 7]]
        assert (reads._held, reads.held_bytes) == ({}, 0)  # noqa: SLF001 - nothing left behind

    asyncio.run(go())


def test_a_full_shuffle_reads_batch_by_batch(seg_url, tmp_path) -> None:
    src = RecordingSource(seg_url, tmp_path / "reads.jsonl")
    got = ids(list(AsyncLoader(src, batch_size=16, seed=3, shuffle=True, shuffle_block=1)))
    assert got == EpochSampler(ROWS, 16, shuffle=True, seed=3).batches(0)
    # one request per batch, the first batch's first sample alone: nothing read ahead in blocks
    assert src.reads == [got[0][:1], got[0][1:], *got[1:]]


def test_a_resumed_epoch_reads_only_the_rows_it_has_left(seg_url, tmp_path) -> None:
    src = RecordingSource(seg_url, tmp_path / "reads.jsonl")
    first = AsyncLoader(src, batch_size=16, seed=5, **OPTS)
    it = iter(first)
    taken = ids([next(it) for _ in range(6)])
    state = first.state_dict()
    it.close()
    src.forget()
    second = AsyncLoader(src, batch_size=16, seed=5, **OPTS)
    second.load_state_dict(state)
    rest = ids(list(second))
    assert Counter(flat(taken + rest)) == Counter(range(ROWS))
    assert Counter(flat(src.reads)) == Counter(flat(rest))  # each row of the rest read once, no other


def test_rows_read_ahead_of_the_consumer_stay_within_the_window(seg_url, tmp_path) -> None:
    """What the blocks hold is bounded by the order, seen from outside: rows read but not yet yielded
    never exceed a window's worth plus what the pipeline itself keeps in flight and ready."""
    src = RecordingSource(seg_url, tmp_path / "reads.jsonl")
    loader = AsyncLoader(src, batch_size=8, seed=1, concurrency=16, prefetch=2, **OPTS)
    ahead = []
    yielded = 0
    for b in loader:
        yielded += len(b["index"])
        ahead.append(len(flat(src.reads)) - yielded)
    in_pipeline = 16 + (2 + 2 + 1) * 8  # in flight, ready and assembling (Plan.slots)
    assert max(ahead) <= 2 * WINDOW + BLOCK + in_pipeline


def test_the_default_reader_process_and_check_resume(seg_url) -> None:
    """The default isolation (a reader process) with blocks: the shared save/load checks."""
    src = DeepLakeSource(seg_url)
    check_resume(lambda: AsyncLoader(src, batch_size=16, seed=4, prefetch=2, **OPTS), in_order=True, epochs=1)


def test_dataloader_workers_share_the_block_order_exactly_once(seg_url) -> None:
    ds = AsyncIterableDataset(DeepLakeSource(seg_url), batch_size=16, seed=7, concurrency=16, **OPTS)
    ds.set_epoch(1)
    got = ids(list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)))
    assert got == EpochSampler(ROWS, 16, shuffle=True, seed=7, block=BLOCK, window=WINDOW).batches(1)


def test_a_bad_row_in_a_block_is_named_alone_and_skipped_alone(seg_url) -> None:
    bad = 37
    src = FailingSource(seg_url, bad={bad})
    with pytest.raises(ReadError, match=f"unreadable object for sample {bad}") as err:
        list(AsyncLoader(src, batch_size=16, seed=2, **OPTS))
    assert bad in err.value.indices and len(err.value.indices) <= 16  # the batch's own request, not the block
    loader = AsyncLoader(src, batch_size=16, seed=2, on_error="skip", **OPTS)
    got = flat(ids(list(loader)))
    assert Counter(got) == Counter(i for i in range(ROWS) if i != bad)
    assert loader.stats()["skipped"] == 1
