"""The pipeline of one epoch, driven directly (a ``Plan`` in, ``Ready`` items out) on real Deep Lake
datasets: the byte budget bounds what is alive, batches come in plan order or as they finish, and a
mask read again for the decode stage goes through the same gate and counts as every other read. Also
the byte budget on its own (``engine.budget``), and the pipeline's independence from the image package."""

from __future__ import annotations

import asyncio
import queue
import time
from typing import Any

import deeplake
import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, DeepLakeSource, LoaderOptions
from asyncload.engine.budget import ByteBudget, batch_bytes, part_bytes
from asyncload.engine.pipeline import Pipeline
from asyncload.engine.plan import Plan, ReadStage
from asyncload.engine.protocol import END, Failure, Ready
from asyncload.engine.stats import Stats
from asyncload.image.decode import decode_stage
from asyncload.runtime.loop import LoopThread
from asyncload.sources.base import Columns
from tests.photo_data import make, make_odd_masks
from tests.sources import DelayedSource
from tests.test_layout import import_graph


def plan_of(source: Any, rows: int, batch_size: int, **kw: Any) -> Plan:
    """A plan over ``rows`` rows in order, one request per batch unless ``kw`` says otherwise."""
    batches = [(s, list(range(a, min(a + batch_size, rows)))) for s, a in enumerate(range(0, rows, batch_size))]
    settings: dict[str, Any] = dict(
        request_size=batch_size, fetchers=4, requests=4, batch_size=batch_size, prefetch=2, in_order=True,
        transform=None, collate_fn=None, with_index=True, on_error="raise", hedge=None,
    )  # fmt: skip
    settings.update(kw)
    return Plan(source=source, batches=batches, **settings)


def run_epoch(plan: Plan, pause_s: float = 0.0) -> tuple[list[Ready], Stats]:
    """Every item the pipeline delivers for ``plan``, taken as a consumer takes them (each hands its slot
    back), ``pause_s`` apart; and the epoch's stats."""
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    stats = Stats()
    lt = LoopThread(cpu_workers=1)
    pipeline = Pipeline(plan, out, lt, stats)
    lt.start()
    got: list[Ready] = []
    try:
        done = lt.submit(pipeline.run())
        while (item := out.get(timeout=30)) is not END:
            if isinstance(item, Failure):
                raise item.exc
            got.append(item)
            time.sleep(pause_s)
            lt.call_soon(pipeline.release_slot)
        done.result(timeout=30)
    finally:
        lt.stop()
    return got, stats


# -- order ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_order", [True, False])
def test_batches_come_in_plan_order_or_as_they_finish(seg_url: str, in_order: bool) -> None:
    """The second batch's read is slow: in order, the batches after it wait for it; out of order, they
    overtake it. (The first batch's read goes out alone, so the slow one is the second.)"""
    src = DelayedSource(seg_url, lambda idx: 0.5 if idx[0] == 8 else 0.0).open()
    got, stats = run_epoch(plan_of(src, 32, 8, in_order=in_order))
    seqs = [r.seq for r in got]
    if in_order:
        assert seqs == [0, 1, 2, 3]
    else:
        assert seqs[0] == 0 and seqs[-1] == 1 and sorted(seqs) == [0, 1, 2, 3]
    for r in got:  # each batch is its own rows, whatever the order
        assert r.batch["index"].tolist() == list(range(8 * r.seq, 8 * r.seq + 8))
    # the first batch in two requests: its first sample alone (the budget's first measure), then the rest
    assert stats.requests == 5 and stats.samples_read == 32 and stats.in_flight == 0


# -- a mask read again ----------------------------------------------------------------------------------

ODD = (5, 11)  # rows whose lz4 mask is not the size of its image


@pytest.fixture(scope="module")
def odd_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_odd_masks("file://" + str(tmp_path_factory.mktemp("odd") / "ds"), 16, ODD, seed=4)


class Recording(DelayedSource):
    """A delayed Deep Lake source that notes each read: its indices and the columns it returned as stored
    bytes."""

    def __init__(self, url: str, delay_s: float) -> None:
        super().__init__(url, lambda idx: delay_s)
        self.asked: list[tuple[list[int], frozenset[str]]] = []

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        self.asked.append((list(indices), raw))
        return await super().read(indices, raw)


def test_a_mask_read_again_goes_through_the_gate_and_is_counted(odd_url: str) -> None:
    """One request allowed in flight, two fetchers, two requests a batch: the read again of a mismatched
    mask (row 5, after the second request of batch 0) would overlap the first request of batch 1 if it
    went around the gate; it waits on the gate like any read (the store never sees two at once), is a
    request in the stats, and its samples are not counted twice. The store decodes that mask, so it keeps
    its own size."""
    src = Recording(odd_url, 0.05).open()
    stage = decode_stage(src, LoaderOptions())
    assert stage is not None and stage.lz4 == ("masks",)
    plan = plan_of(src, 16, 8, request_size=4, fetchers=2, requests=1, stage=stage, ragged="list")
    got, stats = run_epoch(plan)
    # the first batch: its first sample alone, then the rest in requests of 4; the second batch in 4s
    cut = [(0,), (1, 2, 3, 4), (5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert src.asked[0][0] == [0]
    assert sorted(tuple(ix) for ix, _ in src.asked) == sorted([*cut, (5,), (11,)])
    again = {ix[0]: cols for ix, cols in src.asked[1:] if len(ix) == 1}
    assert again == {5: frozenset({"images"}), 11: frozenset({"images"})}  # the masks decoded by the store
    assert src.max_in_flight == 1
    assert stats.requests == len(src.asked) == 7 and stats.samples_read == 16 and stats.in_flight == 0
    masks = {i: m for r in got for i, m in zip(r.batch["index"].tolist(), r.batch["masks"], strict=True)}
    assert sorted(masks) == list(range(16))
    assert all(tuple(masks[i].shape) == ((32, 48) if i in ODD else (64, 64)) for i in masks)
    ds = deeplake.open_read_only(odd_url)
    for i in ODD:
        assert np.array_equal(masks[i].numpy(), np.asarray(ds[i]["masks"]).reshape(32, 48))


def test_the_decode_stage_is_what_the_pipeline_asks_it_for_and_the_pipeline_imports_no_image_code(
    odd_url: str,
) -> None:
    stage = decode_stage(DeepLakeSource(odd_url).open(), LoaderOptions())
    assert isinstance(stage, ReadStage)
    graph = import_graph()
    assert not [m for m in graph["asyncload.engine.pipeline"] if m.startswith("asyncload.image")]
    assert not [m for m in graph["asyncload.engine.budget"] if m.startswith("asyncload.image")]


# -- the byte budget ------------------------------------------------------------------------------------


def test_the_budget_admits_one_batch_until_a_read_is_measured_then_what_fits() -> None:
    """10 samples of 10 bytes a batch, decoding to twice that: 300 bytes a batch alive, 3 of which pass a
    budget of 1000. Room is waited for, given back when the consumer takes a batch, and free once closed."""
    stats = Stats()
    ratios: list[int] = []

    def decoded_ratio(part: dict[str, Any]) -> float:
        ratios.append(len(part))
        return 2.0

    budget = ByteBudget(1000, 10, stats, decoded_ratio)
    assert stats.memory_budget == 1000 and budget.fits()
    budget.admit()
    assert not budget.fits()  # nothing measured yet: the first batch alone
    part = {"a": [b"x" * 10] * 10}
    assert budget.read(part, 10) == 100 and stats.bytes_held == 100 and ratios == [1]
    assert budget.fits()
    budget.admit()
    assert budget.fits()
    budget.admit()
    assert not budget.fits()
    budget.read(part, 10)
    assert ratios == [1]  # the guess is made once, from the first read

    async def wait_then_take() -> bool:
        room = asyncio.ensure_future(budget.room())
        await asyncio.sleep(0.01)
        waited = not room.done()
        budget.assembled(200)
        budget.ready({"a": torch.zeros(10, 20, dtype=torch.uint8)}, 10)
        budget.taken()
        await asyncio.wait_for(room, 1)
        return waited

    assert asyncio.run(wait_then_take())
    assert budget.alive == 2 and stats.bytes_held == 0 and stats.bytes_held_peak == 200
    budget.admit()
    budget.admit()
    assert not budget.fits()
    budget.close()
    assert budget.fits()


def test_bytes_are_counted_for_arrays_stored_bytes_views_and_batches() -> None:
    arr = np.zeros((4, 5), np.uint16)
    assert part_bytes({"a": arr, "b": [b"abc", memoryview(b"defg"), bytearray(2), arr[0]]}) == 40 + 3 + 4 + 2 + 10
    batch = {"x": torch.zeros(3, 4, dtype=torch.int32), "y": [torch.zeros(2), torch.zeros(1)], "n": "name"}
    assert batch_bytes(batch) == 48 + 8 + 4


@pytest.fixture(scope="module")
def large_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make(str(tmp_path_factory.mktemp("large") / "ds"), 48, image_format="jpg", sizes=(512, 512))


@pytest.mark.parametrize("decode", ["cpu", "store"])
def test_the_byte_budget_bounds_what_the_pipeline_holds(large_url: str, decode: str) -> None:
    """A slow consumer lets the pipeline fill up to whatever bounds it: the budget, or else the slots."""
    batch = 4 * (512 * 512 * 4)  # one batch of images and masks, decoded
    budget = 2 * batch

    def peak(**opts: object) -> tuple[list[int], dict]:
        loader = AsyncLoader(DeepLakeSource(large_url), 4, decode=decode, concurrency=64, prefetch=8, **opts)
        got = []
        for b in loader:
            got += b["index"].tolist()
            time.sleep(0.05)
        return sorted(got), loader.stats()

    got, st = peak(memory_budget=budget)
    assert got == list(range(48)) and st["memory_budget"] == budget
    assert 0 < st["bytes_held_peak"] <= budget + batch  # (estimates are per sample: one batch of slack)
    assert st["bytes_held"] == 0  # every byte counted in, read or decoded, was counted out
    got, unbounded = peak()
    assert got == list(range(48))
    assert unbounded["bytes_held_peak"] >= 4 * batch  # the bound above is the budget's doing


def test_a_sample_larger_than_the_budget_does_not_deadlock(large_url: str) -> None:
    loader = AsyncLoader(DeepLakeSource(large_url), 4, memory_budget=1000)
    assert sorted(i for b in loader for i in b["index"].tolist()) == list(range(48))
