"""Steady-state CPU per sample: epochs 1.. of one reader on local disk (tree CPU from /proc)."""

import os
import sys
import time

sys.path.insert(0, ".")
from benchmarks.peers.harness import index_order, tree_cpu_s

url, which, ne = sys.argv[1], sys.argv[2], int(sys.argv[3])
rows = 4000 if "4000" in url else 1000


def run_epochs():
    if which.startswith("al"):
        from asyncload import AsyncLoader, DeepLakeSource

        kw = {} if which == "al" else {"processes": 0}
        ld = AsyncLoader(DeepLakeSource(url), batch_size=32, shuffle=True, seed=0, **kw)
        for e in range(ne):
            ld.set_epoch(e)
            yield (len(b["index"]) for b in ld)
        ld.close()
    else:
        from benchmarks.peers import bytes_jpeg

        spec = {"url": url, "options": {"masks": "bytes", "png": "spng"}}
        for e in range(ne):
            yield (len(b["images"]) for b in bytes_jpeg.batches(spec, index_order(rows, "shuffled", e)))


res = []
for _e, it in enumerate(run_epochs()):
    t = time.perf_counter()
    c = tree_cpu_s(os.getpid())
    n = sum(it)
    el = time.perf_counter() - t
    cpu = tree_cpu_s(os.getpid()) - c
    res.append((round(n / el), round(cpu / n * 1000, 3)))
print(which, res)
