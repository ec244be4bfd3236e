"""The plain Deep Lake reader: what a user who knows ``get_async`` writes in ~30 lines.

Column ``get_async`` of 64 indices per column, 4 requests in flight on a loop thread, Deep Lake's storage
pool at 64, batches handed over in order through a bounded queue; Deep Lake decodes. ``ceiling`` is the
same reader on a local copy. Every table's ratios are against this reader in the same run.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .common import open_dataset


def batches(spec: dict[str, Any], order: list[int], request: int = 64, inflight: int = 4) -> Iterator[Any]:
    ds = open_dataset(spec)
    out: queue.Queue[Any] = queue.Queue(maxsize=inflight)

    async def fetch(idx: list[int]) -> dict[str, torch.Tensor]:
        images, masks = await asyncio.gather(ds["images"].get_async(idx), ds["masks"].get_async(idx))
        return {"images": torch.from_numpy(np.stack(images)), "masks": torch.from_numpy(np.stack(masks))}

    async def produce() -> None:
        pending: list[asyncio.Task[Any]] = []
        for start in range(0, len(order), request):
            pending.append(asyncio.create_task(fetch(order[start : start + request])))
            if len(pending) >= inflight:
                out.put(await pending.pop(0))
        for task in pending:
            out.put(await task)
        out.put(None)

    threading.Thread(target=asyncio.run, args=(produce(),), daemon=True, name="loop").start()
    while (batch := out.get()) is not None:
        yield batch
