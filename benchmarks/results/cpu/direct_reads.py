"""The reader process's reads without the process: where the loop thread's CPU goes, and how often the poller looks.

    TREE=/path/to/checkout [COUNT=1] [INFLIGHT=8] [BLOCK=32] [POOL=128] \
        nice -n 5 .venv/bin/python benchmarks/results/cpu/direct_reads.py URL ['{"aws_access_key_id": ...}']

``DeepLakeSource.read`` of shuffled 32-row blocks, stored bytes of every column (as the reader process is
asked for them), ``INFLIGHT`` at a time, on a ``LoopThread`` as in the reader; no frames, no decoding. Prints
the threads' CPU per sample (``schedstat``: the loop thread, Deep Lake's storage threads ``B_*`` and its
``MainQueueThread``) and, with ``COUNT=1``, how many times the poller looked (``polls``) and how many of those
looks found nothing (``empty_polls``), with their CPU.
"""

import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.environ.get("TREE", str(__import__("pathlib").Path(__file__).resolve().parents[3])))
import asyncio


def tcpu():
    out = {}
    for t in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            name = open(f"/proc/self/task/{t}/comm").read().strip()
            ns = int(open(f"/proc/self/task/{t}/schedstat").read().split()[0])
        except OSError:
            continue
        out[int(t)] = (name, ns / 1e9)
    return out


import asyncload.runtime.polled as P  # noqa: E402 - after the tree's path

PC = {"n": 0, "cpu": 0.0, "scan": 0}
_orig = P._Poller.poll


def _poll(self):
    PC["n"] += 1
    PC["scan"] += len(self.pending)
    c = time.thread_time()
    before = len(self.pending)
    _orig(self)
    d = time.thread_time() - c
    PC["cpu"] += d
    if len(self.pending) == before:
        PC["empty"] = PC.get("empty", 0) + 1
        PC["empty_cpu"] = PC.get("empty_cpu", 0) + d


if os.environ.get("COUNT"):
    P._Poller.poll = _poll
from asyncload.runtime.loop import LoopThread  # noqa: E402 - after the tree's path
from asyncload.sources.deeplake import DeepLakeSource  # noqa: E402 - after the tree's path

url = sys.argv[1]
creds = json.loads(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else None
inflight = int(os.environ.get("INFLIGHT", "8"))
src = DeepLakeSource(url, creds=creds, storage_concurrency=int(os.environ.get("POOL", "128")))
src.open()
n = len(src.handle())
B_ = int(os.environ.get("BLOCK", "32"))
blocks = [list(range(i, min(i + B_, n))) for i in range(0, n, B_)]
random.Random(0).shuffle(blocks)
lt = LoopThread("rl", cpu_workers=1)
lt.start()
loop_tid = {}


async def main():
    loop_tid["tid"] = threading.get_native_id()
    sem = asyncio.Semaphore(inflight)

    async def one(b):
        async with sem:
            out = await src.read(b, frozenset(src.columns))
            return sum(len(v) for v in out["images"])

    return sum(await asyncio.gather(*(one(b) for b in blocks)))


t0c = tcpu()
t0 = time.perf_counter()
total = lt.submit(main()).result()
dt = time.perf_counter() - t0
t1c = tcpu()
g = {}
for tid, (name, c) in t1c.items():
    nm = "loop" if tid == loop_tid["tid"] else name.rstrip("0123456789_")
    g[nm] = g.get(nm, 0) + c - t0c.get(tid, (name, 0))[1]
print(
    json.dumps(
        {
            "empty_polls": PC.get("empty"),
            "empty_ms_per_sample": round(PC.get("empty_cpu", 0) * 1000 / n, 4),
            "polls": PC["n"],
            "poll_ms_per_sample": round(PC["cpu"] * 1000 / n, 4),
            "scans": PC["scan"],
            "rows": n,
            "s": round(dt, 2),
            "per_s": round(n / dt),
            "ms_per_sample": {
                k: round(1000 * v / n, 3) for k, v in sorted(g.items(), key=lambda kv: -kv[1]) if v > 0.001
            },
        }
    )
)
os._exit(0)
