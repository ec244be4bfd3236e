"""Where the isolation's fixed cost goes at 50 ms: CPU and seconds of each phase of opening a Deep Lake
source, in the training process and in a reader process. Run as root from the repository root:

    python benchmarks/results/open_once/phases.py [--rows 4000] [--fmt jpg]

It builds the ``make bench`` world (packet-level NFQUEUE, SeaweedFS, the photo datasets), then measures in
fresh processes of the client namespace (the harness's forkserver, which preloaded torch, Deep Lake and
asyncload, as in ``make bench``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def _cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def phases(url: str, creds: dict[str, str]) -> dict[str, float]:
    """In the training process: the probe, Deep Lake's open, the schema; then a reader's first answer."""
    import asyncio

    from asyncload import DeepLakeSource
    from asyncload.processes.isolated import IsolatedSource
    from asyncload.sources.stores.probe import probe_s3_url
    from benchmarks.peers.harness import proc_cpu_s

    out: dict[str, float] = {}
    c, t = _cpu(), time.perf_counter()
    probe_s3_url(url, creds)
    out["probe_cpu"], out["probe_s"] = _cpu() - c, time.perf_counter() - t
    src = DeepLakeSource(url, creds=creds, probe=False)
    c, t = _cpu(), time.perf_counter()
    src.open()
    out["open_cpu"], out["open_s"] = _cpu() - c, time.perf_counter() - t
    c, t = _cpu(), time.perf_counter()
    src.image_columns()
    len(src)
    out["schema_cpu"], out["schema_s"] = _cpu() - c, time.perf_counter() - t
    iso = IsolatedSource(DeepLakeSource(url, creds=creds), needs_main=False)
    t = time.perf_counter()
    iso.start()
    asyncio.run(iso.read([0]))
    out["reader_first_answer_s"] = time.perf_counter() - t
    out["reader_cpu_at_first_answer"] = proc_cpu_s(iso.pid)
    with open(f"/proc/{iso.pid}/maps") as f:
        out["reader_has_aiohttp"] = float("aiohttp" in f.read())
    iso.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--fmt", default="jpg")
    ap.add_argument("--rtt-ms", type=float, default=50)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--what", default="phases", choices=["phases", "epoch", "epoch0", "ab"])
    ap.add_argument("--trees", nargs="*", default=[], help="with --what ab: checkouts to compare, interleaved")
    a = ap.parse_args()
    from benchmarks.peers.harness import Runner
    from benchmarks.testbeds.world import DatasetSpec, world

    with world(ROOT / "data" / "bench") as w:
        w.add("ds", DatasetSpec(a.rows, a.fmt))
        w.set_rtt(a.rtt_ms)
        run = Runner(120, enter=w.net.enter_client)
        for _ in range(a.reps):
            if a.what == "ab":
                calls = [("epoch_of", (t,)) for t in a.trees]
            else:
                calls = [("epoch", (0,)) if a.what == "epoch0" else (a.what, ())]
            for fn, extra in calls:
                spec = {"call": ("benchmarks.results.open_once.phases", fn, (w.url("ds", False), w.creds, *extra))}
                out = run(spec)
                out = {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}
                print(json.dumps({"run": [fn, *extra], **out}), flush=True)


if __name__ == "__main__":
    main()


def epoch(url: str, creds: dict[str, str], processes: Any = "auto") -> dict[str, Any]:
    """One whole shuffled first epoch with the defaults: the reader's CPU at its first answer, at the first
    batch and at the end, by thread; this process's at the same points."""
    from asyncload import AsyncLoader, DeepLakeSource
    from benchmarks.peers.harness import proc_cpu_s, thread_cpu_s

    c0, t0 = _cpu(), time.perf_counter()
    loader = AsyncLoader(DeepLakeSource(url, creds=creds), 32, shuffle=True, processes=processes)
    out: dict[str, Any] = {"built_s": time.perf_counter() - t0, "built_cpu": _cpu() - c0}
    pid = loader._isolated.pid if loader._isolated is not None else None
    n = 0
    for b in loader:
        if not n:
            out["first_batch_s"] = time.perf_counter() - t0
            out["first_batch_cpu"] = _cpu() - c0
            out["first_batch_reader_cpu"] = proc_cpu_s(pid) if pid else 0.0
        n += len(b["index"])
    out["s"], out["cpu"] = time.perf_counter() - t0, _cpu() - c0
    out["samples_per_s"] = n / out["s"]
    if pid:
        out["reader_cpu"] = proc_cpu_s(pid)
        out["reader_threads"] = {k: round(v, 3) for k, v in thread_cpu_s(pid).items()}
    out["parent_threads"] = {k: round(v, 3) for k, v in thread_cpu_s().items()}
    loader.close()
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


_EPOCH_CHILD = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from asyncload import AsyncLoader, DeepLakeSource
from benchmarks.peers.harness import tree_cpu_s
import os
creds = json.loads(sys.argv[3])
t0 = time.perf_counter(); c0 = tree_cpu_s(os.getpid())
loader = AsyncLoader(DeepLakeSource(sys.argv[2], creds=creds), 32, shuffle=True)
n = 0; first = None
for b in loader:
    n += len(b["index"])
    first = first or time.perf_counter() - t0
s = time.perf_counter() - t0
print(json.dumps({"samples_per_s": n / s, "first_batch_s": first, "cpu_ms_per_sample": (tree_cpu_s(os.getpid()) - c0) * 1e3 / n}))
os._exit(0)
"""


def epoch_of(url: str, creds: dict[str, str], tree: str) -> dict[str, Any]:
    """``epoch`` with the defaults, in a fresh interpreter whose asyncload is the checkout at ``tree``
    (an A/B of two commits in one world, interleaved): opening to the last sample, the process tree's CPU."""
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _EPOCH_CHILD, tree, url, json.dumps(creds)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": tree},
    )  # fmt: skip
    if out.returncode:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])
