"""Deep Lake's own anonymous memory over whole epochs of block reads, with no asyncload in the path: one
process, ``get_bytes_async`` of 64 contiguous rows per column, blocks in a shuffled order, 16 requests in
flight, the RssAnon of the process after each epoch.

    POOL=128 EPOCHS=10 .venv/bin/python benchmarks/results/cpu/deeplake_memory.py [dataset directory]

``POOL``: Deep Lake's storage threads (``deeplake.storage.set_concurrency``).
"""

import asyncio
import os
import random
import sys

import deeplake

from asyncload.runtime.polled import completion

URL = "file://" + os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "data/bench/photos-4000-jpg")


def anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) // 1024
    return 0


deeplake.storage.set_concurrency(int(os.environ.get("POOL", "128")))
ds = deeplake.open_read_only(URL)
n = len(ds)
print("open", anon())


async def epoch(seed: int, inflight: int = 16) -> None:
    starts = list(range(0, n, 64))
    random.Random(seed).shuffle(starts)
    sem = asyncio.Semaphore(inflight)

    async def one(a: int) -> None:
        async with sem:
            rows = list(range(a, min(a + 64, n)))
            fs = [ds["images"].get_bytes_async(rows), ds["masks"].get_bytes_async(rows)]
            for f in fs:
                await completion(f)

    await asyncio.gather(*(one(a) for a in starts))


for ep in range(int(os.environ.get("EPOCHS", "3"))):
    asyncio.run(epoch(ep))
    print("epoch", ep, anon())
