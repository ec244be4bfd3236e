"""What every reader module shares: opening a dataset the way its spec says, and the plain readers' loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any


def open_dataset(spec: dict[str, Any], pool: int | None = 64) -> Any:
    """The spec's dataset, read-only, with Deep Lake's storage pool set to ``pool`` first (the pool is
    process-wide and sized when a dataset opens; 64 is what the plain readers were tuned to on the WAN), or
    to the reader's ``pool`` option where it has one."""
    import deeplake

    pool = (spec.get("options") or {}).get("pool", pool)
    if pool is not None:
        deeplake.storage.set_concurrency(pool)
    creds = spec.get("creds")
    return deeplake.open_read_only(spec["url"], creds=creds) if creds else deeplake.open_read_only(spec["url"])


def in_order(
    fetch: Callable[[list[int]], Awaitable[Any]], order: list[int], request: int, inflight: int
) -> Iterator[Any]:
    """What the plain readers share: ``fetch`` of ``request`` indices at a time with ``inflight`` requests
    kept in flight, on an event loop of a thread of its own, batches yielded in ``order``'s order."""
    out: queue.Queue[Any] = queue.Queue(maxsize=inflight)

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
