"""What a loader's start costs the training process: CPU and memory from ``import asyncload`` to the first
batch, for a Deep Lake dataset in a bucket (a SeaweedFS on loopback, no latency emulated: this is the
process's own work), in fresh interpreters that imported torch first, as a training script has. The
reader process's CPU is its own, not counted here.

    .venv/bin/python benchmarks/results/cpu/start_cost.py data/bench/photos-4000-jpg [RUNS] [TREE ...]

Each ``TREE`` is a checkout of asyncload (``before=/tmp/wt-before``), the working directory of its runs and first on
``PYTHONPATH`` (ahead of an editable install); the runs
alternate between them. Without one, this checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, os, resource, sys, time
import torch  # a training script's own import, before asyncload's
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before, r0, cpu0 = resource.getrusage(resource.RUSAGE_SELF), rss_mb(), time.process_time()
began = time.perf_counter()
from asyncload import AsyncLoader, DeepLakeSource
loader = AsyncLoader(DeepLakeSource(sys.argv[1], creds=json.loads(sys.argv[2])), 32, shuffle=True, seed=0)
built, built_cpu = time.perf_counter(), time.process_time()
next(iter(loader))
first = time.perf_counter()
after = resource.getrusage(resource.RUSAGE_SELF)
cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
print(json.dumps({
    "cpu_s": cpu, "built_cpu_s": built_cpu - cpu0, "rss_mb": rss_mb() - r0, "built_s": built - began, "first_batch_s": first - began,
    "threads": len(os.listdir("/proc/self/task")),
    "imported": sorted(m for m in ("deeplake", "aiohttp") if m in sys.modules),
}))
loader.close()
"""


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    from harness.seaweed import SeaweedServer

    data = Path(sys.argv[1]).resolve()
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    trees = dict(t.split("=", 1) for t in sys.argv[3:]) or {"this": str(Path(__file__).resolve().parents[3])}
    with SeaweedServer() as server:
        server.start()
        server.create_bucket("start-cost")
        server.put_tree("start-cost", data.name, data)
        url, creds = f"s3://start-cost/{data.name}", json.dumps(server.creds("start-cost"))
        got: dict[str, list[dict[str, object]]] = {name: [] for name in trees}
        for _ in range(runs):
            for name, tree in trees.items():
                env = {**os.environ, "PYTHONPATH": tree, "ASYNCLOAD_CACHE_DIR": f"/tmp/start-cost-{os.getpid()}"}
                p = subprocess.run(
                    [sys.executable, "-c", CHILD, url, creds], env=env, cwd=tree, capture_output=True, text=True
                )
                if p.returncode:
                    raise SystemExit(p.stderr[-2000:])
                got[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
                shutil.rmtree(env["ASYNCLOAD_CACHE_DIR"], ignore_errors=True)
    for name, rows in got.items():
        med = {
            k: statistics.median(float(r[k]) for r in rows)
            for k in ("cpu_s", "built_cpu_s", "rss_mb", "built_s", "first_batch_s")
        }
        print(json.dumps({"tree": name, "runs": runs, **{k: round(v, 3) for k, v in med.items()},
                          "threads": rows[0]["threads"], "imported": rows[0]["imported"]}))  # fmt: skip


if __name__ == "__main__":
    main()
