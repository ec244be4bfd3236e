"""What the reader process adds per sample, reads only: one epoch of stored bytes (64 rows a request,
8 in flight), CPU of this process and the reader's. Run: python reader_ipc.py URL direct|iso"""

import asyncio
import os
import sys
import time

sys.path.insert(0, ".")
from asyncload import DeepLakeSource
from asyncload.processes.isolated import IsolatedSource
from benchmarks.peers.harness import proc_cpu_s

url, mode = sys.argv[1], sys.argv[2]
src = DeepLakeSource(url)
src.open()
rows = len(src)
s = IsolatedSource(src, needs_main=False) if mode == "iso" else src
if mode == "iso":
    s.start()


async def epoch():
    raw = frozenset({"images", "masks"})
    sem = asyncio.Semaphore(8)

    async def one(i):
        async with sem:
            return await s.read(list(range(i, min(i + 64, rows))), raw)

    await asyncio.gather(*(one(i) for i in range(0, rows, 64)))


asyncio.run(epoch())  # warm
res = []
for _ in range(5):
    c = proc_cpu_s(os.getpid()) + (proc_cpu_s(s.pid) if mode == "iso" else 0)
    t = time.perf_counter()
    asyncio.run(epoch())
    el = time.perf_counter() - t
    cpu = proc_cpu_s(os.getpid()) + (proc_cpu_s(s.pid) if mode == "iso" else 0) - c
    res.append(round(cpu / rows * 1000, 4))
print(mode, "cpu ms/sample", res)
if mode == "iso":
    s.close()
