"""The cost of polling Deep Lake's futures (``runtime.polled``) against awaiting them, on the bench's testbed:
whole cold shuffled epochs of asyncload with ``processes=0`` (the loop thread waits on Deep Lake itself), the
two ways alternating in one run, at 50 ms packet-level (root; else the TCP proxy) or from local disk.

    python benchmarks/results/isolation/probes/polling_cost.py '["await", "poll", "await", "poll"]' jpeg
    LOCAL=1 python benchmarks/results/isolation/probes/polling_cost.py '["await", "poll"]' jpeg

"await" puts back ``await fut`` for the run (it can segfault under garbage collection: that is why it went).
"""

import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from benchmarks.results.first_epoch.probes.raw_reads import each_case


def epoch(url, creds, how):
    import asyncload.sources.deeplake as dl
    from asyncload import AsyncLoader, DeepLakeSource

    if how == "await":

        async def awaited(fut):
            return await fut

        dl.completion = awaited
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    n = 0
    first = None
    with AsyncLoader(DeepLakeSource(url, creds=creds), batch_size=32, processes=0, shuffle=True, seed=1) as ld:
        for b in ld:
            n += len(b["images"])
            first = first or time.perf_counter() - t0
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return {"how": how, "rows": n, "samples_s": round(n / wall), "first_s": round(first, 3),
            "cpu_ms_per_sample": round(cpu / n * 1e3, 3)}  # fmt: skip


if __name__ == "__main__":
    each_case(epoch, spread=False)
