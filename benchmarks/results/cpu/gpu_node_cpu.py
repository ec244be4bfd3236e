"""CPU per sample on a GPU node's CPUs: asyncload's defaults, asyncload in the training process
(``processes=0``) and the lz4 hand-written reader (``get_bytes_async`` + simplejpeg + lz4, 2 threads), each a
whole cold shuffled first epoch of drawn photo-like JPEG + lz4 pairs on local disk, in a fresh process of
``benchmarks.peers.harness.Runner``, runs alternating. Made for a lent device machine, where it needs only
what ``make gpu-check`` needs:

    python3 benchmarks/results/cpu/gpu_node_cpu.py [--rows 16000] [--reps 3] [--data /tmp/asyncload-cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

READERS = {
    "asyncload, defaults": {"reader": "asyncload", "options": {}},
    "asyncload, processes=0": {"reader": "asyncload", "options": {"processes": 0}},
    "get_bytes_async + simplejpeg + lz4, 2 threads": {"reader": "bytes", "options": {"masks": "bytes"}},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=16000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--data", default="/tmp/asyncload-cpu")
    ap.add_argument("--out", type=Path, default=None, help="a JSON file for every run")
    a = ap.parse_args()
    from benchmarks.peers.harness import Runner
    from benchmarks.suites.gpu_check import make_data

    data = make_data(f"{a.data}-{a.rows}", a.rows)
    run = Runner(timeout_s=600)
    rows: list[dict] = []
    for rep in range(a.reps):
        for name, r in READERS.items():
            spec = {"reader": r["reader"], "workers": 0, "options": dict(r["options"]), "env": {},
                    "url": data["url"], "creds": None, "order": "shuffled", "rows": data["rows"], "limit": None,
                    "epoch_s": 600.0}  # fmt: skip
            m = run(spec)
            rows.append({"reader": name, "rep": rep, "m": m})
            print(json.dumps({"reader": name, "rep": rep, **{k: m.get(k) for k in (
                "run_samples_per_s", "cpu_ms_per_sample", "peak_rss_mb", "first_batch_s", "error")}}), flush=True)  # fmt: skip
    base = "get_bytes_async + simplejpeg + lz4, 2 threads"

    def med(name: str, key: str) -> float:
        return statistics.median(r["m"][key] for r in rows if r["reader"] == name and key in r["m"])

    print(f"\n{data['rows']:,} rows, {data['bytes_per_pair'] / 1e3:.1f} KB a pair, local disk, {os.cpu_count()} CPUs")
    print("| reader | samples/s | × hand-written | CPU ms/sample | × hand-written | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for name in READERS:
        sps, cpu = med(name, "run_samples_per_s"), med(name, "cpu_ms_per_sample")
        print(f"| {name} | {sps:,.0f} | {sps / med(base, 'run_samples_per_s'):.2f}× | {cpu:.3f} | "
              f"{cpu / med(base, 'cpu_ms_per_sample'):.2f}× | {med(name, 'peak_rss_mb'):.0f} |")  # fmt: skip
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
