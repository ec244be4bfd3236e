"""Assembly (``engine.assembly.assemble``): the parts of one batch, as its reads returned them, become the
batch the consumer gets. Real reads of the session's Deep Lake dataset (PNG images, lz4 masks), with and
without the decode stage; a user's transform and collate_fn; samples skipped or raised; store row ids."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

from asyncload import DeepLakeSource, LoaderOptions
from asyncload.engine.assembly import assemble
from asyncload.engine.plan import Plan
from asyncload.engine.protocol import EMPTY
from asyncload.image.decode import DecodeStage, decode_stage
from asyncload.sources.base import Source
from asyncload.sources.subset import RangeSource


def plan_for(source: Source[Any], **kw: Any) -> Plan:
    """A plan that assembly reads: only its source, stage and per-batch settings matter here."""
    settings: dict[str, Any] = dict(
        batches=[], request_size=4, fetchers=1, requests=1, batch_size=8, prefetch=1, in_order=True,
        transform=None, collate_fn=None, with_index=True, on_error="raise",
    )  # fmt: skip
    settings.update(kw)
    return Plan(source=source, **settings)


def parts(source: Source[Any], groups: list[list[int]], stage: DecodeStage | None = None) -> list[tuple[list, Any]]:
    """Each group read as the pipeline reads it (the stage's columns as stored bytes)."""

    async def read_all() -> list[tuple[list[int], Any]]:
        raw = stage.encoded if stage is not None else frozenset()
        return [(g, await source.read(g, raw)) for g in groups]

    return asyncio.run(read_all())


@pytest.fixture(scope="module")
def src(seg_url: str) -> DeepLakeSource:
    return DeepLakeSource(seg_url).open()


@pytest.mark.parametrize("decoded_here", [False, True])
def test_parts_become_one_batch_in_the_order_given(
    src: DeepLakeSource, seg_arrays: dict[str, np.ndarray], decoded_here: bool
) -> None:
    """Two reads of four rows, given in position order, make one batch of those rows in that order, the
    same whether the store decoded them or the decode stage did (from stored bytes)."""
    stage = decode_stage(src, LoaderOptions()) if decoded_here else None
    if stage is not None:
        assert stage.encoded == {"images", "masks"}
    rows = [[40, 3, 17, 8], [100, 2, 55, 9]]
    got = assemble(plan_for(src, stage=stage), parts(src, rows, stage))
    flat = rows[0] + rows[1]
    assert got.count == 8 and got.skipped == []
    assert got.batch["index"].tolist() == flat
    for c in ("images", "masks"):
        assert isinstance(got.batch[c], torch.Tensor)
        assert np.array_equal(got.batch[c].numpy(), seg_arrays[c][flat]), c
    if not decoded_here:
        assert got.decode_s == 0.0  # no decode stage: all of it is collation


def test_the_index_is_the_stores_row_and_can_be_left_out(src: DeepLakeSource, seg_arrays: dict) -> None:
    sub = RangeSource(src, 100, 120).open()
    got = assemble(plan_for(sub), parts(sub, [[0, 1], [5]]))
    assert got.batch["index"].tolist() == [100, 101, 105]
    assert np.array_equal(got.batch["images"].numpy(), seg_arrays["images"][[100, 101, 105]])
    bare = assemble(plan_for(src, with_index=False), parts(src, [[0, 1]]))
    assert "index" not in bare.batch and set(bare.batch) == {"images", "masks"}


def test_a_transform_sees_decoded_samples_and_collate_fn_the_list(src: DeepLakeSource, seg_arrays: dict) -> None:
    seen: list[Any] = []

    def transform(s: dict[str, Any]) -> dict[str, Any]:
        seen.append(s)
        return {"mean": float(s["images"].mean())}

    stage = decode_stage(src, LoaderOptions())
    plan = plan_for(src, stage=stage, transform=transform, collate_fn=lambda samples: samples)
    got = assemble(plan, parts(src, [[4, 6, 9]], stage))
    assert [s["index"] for s in seen] == [4, 6, 9]
    assert all(isinstance(s["images"], np.ndarray) and s["images"].shape == (40, 56, 3) for s in seen)
    assert np.array_equal(seen[1]["masks"], seg_arrays["masks"][6])
    assert got.count == 3 and [s["index"] for s in got.batch] == [4, 6, 9]  # with_index: kept by assembly
    assert got.batch[0]["mean"] == pytest.approx(float(seg_arrays["images"][4].mean()))


def test_samples_a_transform_rejects_are_skipped_or_raised(src: DeepLakeSource) -> None:
    def transform(s: dict[str, Any]) -> dict[str, Any]:
        if s["index"] % 2:
            raise ValueError(f"odd row {s['index']}")
        return s

    read = parts(src, [[10, 11, 12], [13]])
    got = assemble(plan_for(src, transform=transform, on_error="skip"), read)
    assert got.count == 2 and got.batch["index"].tolist() == [10, 12]
    assert got.skipped == [(11, "ValueError in transform: odd row 11"), (13, "ValueError in transform: odd row 13")]
    with pytest.raises(ValueError, match="odd row 11"):
        assemble(plan_for(src, transform=transform), read)
    none = assemble(plan_for(src, transform=transform, on_error="skip"), parts(src, [[11], [13]]))
    assert none.count == 0 and none.batch is EMPTY and len(none.skipped) == 2


def test_no_parts_make_an_empty_batch(src: DeepLakeSource) -> None:
    got = assemble(plan_for(src), [])
    assert got.count == 0 and got.batch is EMPTY
