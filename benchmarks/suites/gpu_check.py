"""``make gpu-check``: the one prepared GPU run, for the minutes a GPU node is at hand (issue 52).

    python benchmarks/suites/gpu_check.py [--rows 16000] [--quick] [--out benchmarks/results/gpu_check]

Runs from a checkout and the offline wheelhouse (``make wheelhouse``) on a node with no network: it makes
its own local dataset (photo-like 256×256 JPEG q90 + lz4 masks, ``gpu_decode.make_data``), and writes one
folder, ``<out>/<host>-<date>/`` (``results.json``, ``summary.md``) naming the machine. In order, each
part timed, the whole under 8 minutes on one H200 with 16 cores:

1. the CUDA tests (``tests/test_gpu_decode.py``, ``tests/test_device.py``, ``tests/test_normalize.py``);
2. JPEG + lz4 pairs per second into GPU memory, normalized NCHW bf16 through ``DeviceFeed``, with
   ``decode="cuda"`` (nvJPEG) against CPU decode, one process against ``processes=4``, and the CPU
   milliseconds per pair of the whole process tree (``gpu_decode.one_epoch``: a whole shuffled epoch,
   then a second one reported apart);
3. the U-Net's step rate fed by the loader against the model alone on batches already on the GPU
   (``gpu_feed.training``).

Targets (issue 52): >= 20,000 pairs/s into GPU memory, <= 0.3 ms CPU per pair, ``processes=4`` >= 1.0x
one process, the U-Net with the loader >= 0.95x the model alone. Without CUDA the same script runs the
CPU parts at a small size, skips the GPU ones and says so in its summary.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.suites.gpu_decode import make_data, one_epoch  # noqa: E402
from benchmarks.suites.gpu_feed import machine, training  # noqa: E402

READY = {"normalize": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), "layout": "NCHW", "dtype": torch.bfloat16}


def cuda_tests() -> dict[str, Any]:
    t0 = time.perf_counter()
    got = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "tests/test_gpu_decode.py",
         "tests/test_device.py", "tests/test_normalize.py"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    tail = [line for line in got.stdout.splitlines() if " passed" in line or " failed" in line]
    return {"exit": got.returncode, "summary": tail[-1] if tail else got.stdout[-300:], "s": time.perf_counter() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="rows of the dataset (16,000 on a GPU, 1,000 without)")
    ap.add_argument("--quick", action="store_true", help="a smaller run: 1,000 rows, one training epoch")
    ap.add_argument("--data", default="/tmp/asyncload-gpu-check", help="where the dataset is made (kept)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    a = ap.parse_args()
    gpu = torch.cuda.is_available()
    rows = a.rows or (1000 if a.quick or not gpu else 16000)
    where = a.out / f"{socket.gethostname()}-{datetime.date.today().isoformat()}"
    where.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"machine": machine(), "cuda": gpu, "rows": rows, "parts": {}}
    said = [] if gpu else ["no CUDA device: the GPU parts are skipped (decode='cuda' runs as 'cpu', no copy)"]
    t0 = time.perf_counter()
    res["parts"]["cuda_tests"] = cuda_tests()
    url = make_data(f"{a.data}-{rows}", rows)
    runs = [
        ("CPU decode, one process", {"decode": "cpu", **READY}),
        ("decode=cuda, one process", {"decode": "cuda", **READY}),
        ("decode=cuda, processes=4", {"decode": "cuda", "processes": 4, **READY}),
    ]
    res["parts"]["pairs"] = [one_epoch(name, url, feed=True, **opts) for name, opts in runs]
    device = torch.device("cuda" if gpu else "cpu")
    res["parts"]["unet"] = training(
        url, gpu, 1 if a.quick or not gpu else 2, 256, device, decode="cuda", model_ready=True
    )
    res["seconds"] = time.perf_counter() - t0
    (where / "results.json").write_text(json.dumps(res, indent=1, default=str))
    (where / "summary.md").write_text(summary(res, said))
    print(summary(res, said))
    return 0 if res["parts"]["cuda_tests"]["exit"] == 0 else 1


def summary(res: dict[str, Any], said: list[str]) -> str:
    m = res["machine"]
    lines = [
        f"# gpu-check on {m['gpu']} ({m['cpus']} CPUs, Python {m['python']}, torch {m['torch']})",
        "",
        *[f"- {s}" for s in said],
        f"- CUDA tests: {res['parts']['cuda_tests']['summary']} (exit {res['parts']['cuda_tests']['exit']})",
        f"- {res['rows']:,} rows of photo-like 256x256 JPEG q90 + lz4 masks, local disk; whole run "
        f"{res['seconds']:.0f} s",
        "",
        "| pairs into memory (NCHW bf16, normalized) | epoch 1 pairs/s | epoch 2 pairs/s | CPU ms/pair | first batch s |",
        "|---|---|---|---|---|",
    ]
    for r in res["parts"]["pairs"]:
        lines.append(
            f"| {r['reader']} | {r['samples_per_s']:,.0f} | {r.get('epoch2_samples_per_s', 0):,.0f} | "
            f"{r['cpu_ms_per_sample']:.3f} | {r['first_batch_s'] or 0:.2f} |"
        )
    pairs = {r["reader"]: r for r in res["parts"]["pairs"]}
    one, four = pairs["decode=cuda, one process"], pairs["decode=cuda, processes=4"]
    lines += ["", f"processes=4 against one process: {four['samples_per_s'] / one['samples_per_s']:.2f}x"]
    for e in res["parts"]["unet"]:
        if isinstance(e, dict) and e.get("samples_per_s") and e.get("model_only_samples_per_s"):
            lines.append(
                f"U-Net epoch {e.get('epoch')}: {e['samples_per_s']:,.0f} samples/s with the loader, "
                f"{e['model_only_samples_per_s']:,.0f} the model alone ({e['samples_per_s'] / e['model_only_samples_per_s']:.2f}x)"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
