"""A fresh interpreter that reads a Deep Lake dataset in-process while the collector runs finalisers: the
stress under which Deep Lake 4.7.4's ``Future.__await__`` segfaults (``tests/test_deeplake_futures.py``).
Run as ``python -m tests.gc_pressure_child URL``; prints the rows each phase read.

Why this shape: the crash needs a garbage collection that runs a finaliser releasing the GIL to start inside
``__await__`` on the thread that waits for a read, while Deep Lake completes that read on its own thread.

1. ``DeepLakeSource.read`` of single rows on an event loop, with cyclic garbage whose ``__del__`` sleeps made
   before every read and the collector's threshold low: awaiting the futures crashed here in 10 of 10 runs.
2. ``AsyncLoader(processes=0)`` epochs of two batches each, left to the collector mid-epoch (whose finaliser
   stops the epoch and blocks on it), with the same garbage: awaiting crashed 4 of 6 runs of 300 epochs.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import time

from asyncload import AsyncLoader, DeepLakeSource


class _Finalised:
    """Cyclic garbage with a finaliser that releases the GIL (a 0.1 ms sleep)."""

    def __init__(self) -> None:
        self.me = self

    def __del__(self) -> None:
        time.sleep(0.0001)


def reads(url: str, n: int) -> int:
    source = DeepLakeSource(url)
    rows = len(source)

    async def run() -> int:
        got = 0
        for k in range(n):
            for _ in range(20):
                _Finalised()
            got += len((await source.read([k % rows]))["images"])
        return got

    gc.set_threshold(50, 5, 5)
    return asyncio.run(run())


def abandoned_epochs(url: str, epochs: int) -> int:
    gc.set_threshold(100, 2, 2)
    seen = 0
    loader = AsyncLoader(DeepLakeSource(url), batch_size=4, processes=0, shuffle=True, seed=1)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        it = iter(loader)
        for k, batch in enumerate(it):
            seen += len(batch["images"])
            for _ in range(30):
                _Finalised()
            if k == 1:
                break
        it.cycle = it  # type: ignore[attr-defined]  # left to the collector, mid-epoch
    loader.close()
    return seen


if __name__ == "__main__":
    print(reads(sys.argv[1], int(sys.argv[2])), abandoned_epochs(sys.argv[1], int(sys.argv[3])), flush=True)
