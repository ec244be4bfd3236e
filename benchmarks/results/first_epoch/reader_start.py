"""A reader process's start: seconds from spawn to its first answer and its CPU then, and after 200
single-row reads. Run from the repository root: python benchmarks/results/first_epoch/reader_start.py data/bench/photos-4000-jpg"""

import asyncio
import sys
import time

sys.path.insert(0, ".")
from asyncload import DeepLakeSource
from asyncload.processes.isolated import IsolatedSource
from benchmarks.peers.harness import proc_cpu_s

src = DeepLakeSource(sys.argv[1])
src.open()
iso = IsolatedSource(src, needs_main=False)
t0 = time.perf_counter()
iso.start()


async def go(i):
    return await iso.read([i])


asyncio.run(go(0))
t1 = time.perf_counter()
c1 = proc_cpu_s(iso.pid)
for i in range(1, 200):
    asyncio.run(go(i))
print(
    f"first answer {t1 - t0:.3f}s, reader cpu at first answer {c1:.3f}s, after 200 single reads {proc_cpu_s(iso.pid):.3f}"
)
iso.close()
