"""What the default isolation buys and costs, outside the WAN suite (``benchmarks/results/isolation/``).

1. Deep Lake's failing-read crash, through asyncload: a copy of a dataset with its image chunk deleted is
   read for ``--epochs`` epochs (a new ``AsyncLoader`` each, every error caught) in ``--runs`` fresh
   processes, with the defaults and with ``processes=0``; each process either exits 0 or dies by a signal.
2. A reader killed mid-epoch (SIGKILL from outside, as the OOM killer sends): seconds from the kill to the
   new reader's first batch, and whether the epoch still yields every row once.
3. Epochs after the first (``--epochs-data``, local disk): one loader, three shuffled epochs, with the
   defaults and with ``processes=0``, alternating, each pair in fresh processes; samples/s per epoch.

    python benchmarks/suites/isolation.py --rows 2000 --runs 5 --epochs 10
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

EPOCHS = r"""
import sys
from asyncload import AsyncLoadError, AsyncLoader, DeepLakeSource
named = 0
for _ in range(int(sys.argv[3])):
    try:
        for _ in AsyncLoader(DeepLakeSource(sys.argv[1]), batch_size=8, processes=eval(sys.argv[2])):
            pass
    except AsyncLoadError:
        named += 1
print("named errors", named)
"""


def crash_runs(url: str, processes: str, runs: int, epochs: int) -> dict[str, object]:
    codes = []
    for _ in range(runs):
        p = subprocess.run(
            [sys.executable, "-c", EPOCHS, url, processes, str(epochs)], capture_output=True, text=True, cwd=ROOT
        )
        codes.append(p.returncode)
    return {"processes": processes, "runs": runs, "epochs": epochs, "exit_codes": codes,
            "died": sum(c != 0 for c in codes)}  # fmt: skip


def restart_time(url: str) -> dict[str, object]:
    from asyncload import AsyncLoader, DeepLakeSource

    loader = AsyncLoader(DeepLakeSource(url), batch_size=32, shuffle=True)
    it = iter(loader)
    seen = [int(i) for i in next(it)["index"]]
    pid = loader._isolated.pid
    killed = {}
    threading.Timer(0.2, lambda: (killed.setdefault("t", time.perf_counter()), os.kill(pid, signal.SIGKILL))).start()
    gap = 0.0
    for b in it:  # the first batch after the restart is counted is the new reader's
        if not gap and loader.stats()["worker_restarts"]:
            gap = time.perf_counter() - killed["t"]
        seen += [int(i) for i in b["index"]]
    n = len(loader.source)
    result = {"kill_to_new_readers_first_batch_s": round(gap, 3), "rows": n, "every_row_once": sorted(seen) == list(range(n)),
              "worker_restarts": loader.stats()["worker_restarts"]}  # fmt: skip
    loader.close()
    return result


EPOCH_RATES = r"""
import json, sys, time
from asyncload import AsyncLoader, DeepLakeSource
loader = AsyncLoader(DeepLakeSource(sys.argv[1]), batch_size=32, shuffle=True, processes=eval(sys.argv[2]))
rates = []
for e in range(3):
    loader.set_epoch(e)
    t0, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["index"])
    rates.append(round(n / (time.perf_counter() - t0), 1))
loader.close()
print(json.dumps(rates))
"""


def epoch_rates(url: str, pairs: int) -> dict[str, object]:
    runs: dict[str, list[list[float]]] = {"defaults": [], "processes=0": []}
    for _ in range(pairs):
        for name, processes in (("defaults", '"auto"'), ("processes=0", "0")):
            p = subprocess.run([sys.executable, "-c", EPOCH_RATES, url, processes], capture_output=True, text=True,
                               cwd=ROOT, check=True)  # fmt: skip
            runs[name].append(json.loads(p.stdout.strip().splitlines()[-1]))
    med = {k: [sorted(r[e] for r in v)[len(v) // 2] for e in range(3)] for k, v in runs.items()}
    return {"url": url, "runs": runs, "median_per_epoch": med,
            "defaults_over_processes0": [round(a / b, 2) for a, b in zip(med["defaults"], med["processes=0"], strict=True)]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--epochs-data", default=str(ROOT / "data/bench/photos-4000-jpg"))
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/isolation/results.json"))
    a = ap.parse_args()
    from asyncload import make_dataset

    tmp = Path(tempfile.mkdtemp())
    try:
        good = make_dataset(str(tmp / "good"), a.rows, image_format="jpg", sizes=(256, 256), aspect=(1, 1),
                            progress=False)  # fmt: skip
        broken = tmp / "broken"
        shutil.copytree(tmp / "good", broken)
        chunk = max((p for p in broken.rglob("*") if p.is_file() and "_deeplake_log" not in p.parts),
                    key=lambda p: p.stat().st_size)  # fmt: skip
        chunk.unlink()
        out = {
            "defaults": crash_runs(f"file://{broken}", '"auto"', a.runs, a.epochs),
            "processes=0": crash_runs(f"file://{broken}", "0", a.runs, a.epochs),
            "restart": restart_time(good),
        }
        if Path(a.epochs_data).is_dir():
            out["later_epochs_local"] = epoch_rates(f"file://{Path(a.epochs_data).resolve()}", a.pairs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
