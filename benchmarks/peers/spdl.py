"""SPDL 0.8: a source of indices, an async per-row fetch of image and mask at concurrency 64 (Deep Lake's
pool 64; Deep Lake decodes), batches of 32, a collate stage, 2 threads: SPDL's documented shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from asyncload.runtime.polled import completions  # Deep Lake's Future.__await__ segfaults under GC

from .common import open_dataset

BATCH = 32


def batches(spec: dict[str, Any], order: list[int], concurrency: int = 64) -> Iterator[Any]:
    from spdl.pipeline import PipelineBuilder

    ds = open_dataset(spec)

    async def fetch(i: int) -> tuple[Any, Any]:
        row = ds[i]
        return tuple(await completions(row.get_async("images"), row.get_async("masks")))

    def collate(rows: list[tuple[Any, Any]]) -> dict[str, torch.Tensor]:
        return {
            "images": torch.from_numpy(np.stack([r[0] for r in rows])),
            "masks": torch.from_numpy(np.stack([r[1] for r in rows])),
        }

    pipeline = (
        PipelineBuilder()
        .add_source(order)
        .pipe(fetch, concurrency=concurrency, output_order="input")
        .aggregate(BATCH)
        .pipe(collate)
        .add_sink(4)
        .build(num_threads=2)
    )
    with pipeline.auto_stop():
        yield from pipeline.get_iterator(timeout=120)
