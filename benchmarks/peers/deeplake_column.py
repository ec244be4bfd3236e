"""The plain Deep Lake reader: what a user who knows ``get_async`` writes in ~30 lines.

Column ``get_async`` of 64 indices per column, 4 requests in flight on a loop thread, Deep Lake's storage
pool at 64, batches handed over in order through a bounded queue; Deep Lake decodes. ``ceiling`` is the
same reader on a local copy. Every table's ratios are against this reader in the same run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from asyncload.runtime.polled import completions  # Deep Lake's Future.__await__ segfaults under GC

from .common import in_order, open_dataset


def batches(spec: dict[str, Any], order: list[int], request: int = 64, inflight: int = 4) -> Iterator[Any]:
    ds = open_dataset(spec)

    async def fetch(idx: list[int]) -> dict[str, torch.Tensor]:
        images, masks = await completions(ds["images"].get_async(idx), ds["masks"].get_async(idx))
        return {"images": torch.from_numpy(np.stack(images)), "masks": torch.from_numpy(np.stack(masks))}

    yield from in_order(fetch, order, request, inflight)
