"""Issue 23's CPU target: model-ready batches (normalize + layout + dtype) through ``AsyncLoader`` cost at
most 10% samples/s against uint8 NHWC, on a local photo-like JPEG dataset.

    python benchmarks/suites/model_ready.py --rows 2000 --out benchmarks/results/model_ready

One process, ``decode="cpu"``, whole epochs, the configurations alternating ``--repeats`` times so that
drift of a shared machine spreads over all of them; the median per configuration is reported, with the
thread CPU seconds the decode stage reported (``cpu_decode_s``, the model-ready pass included).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncload import AsyncLoader, DeepLakeSource, Resize, make_dataset  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("uint8 NHWC (as decoded)", {}),
    ("normalize, NHWC, float32", {"normalize": (MEAN, STD)}),
    ("normalize, NCHW, float32", {"normalize": (MEAN, STD), "layout": "NCHW"}),
    ("normalize, NCHW, bfloat16", {"normalize": (MEAN, STD), "layout": "NCHW", "dtype": torch.bfloat16}),
]


def epoch(url: str, batch_size: int, opts: dict[str, Any]) -> tuple[float, float]:
    loader = AsyncLoader(DeepLakeSource(url), batch_size, shuffle=True, decode="cpu", augment=[Resize(256)], **opts)
    t0, n = time.perf_counter(), 0
    for b in loader:
        n += len(b["index"])
    wall = time.perf_counter() - t0
    st = loader.stats()
    loader.close()
    return n / wall, 1e3 * float(st.get("cpu_decode_s") or 0.0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--data", default="/tmp/model-ready-jpeg")
    ap.add_argument("--out", default="benchmarks/results/model_ready")
    args = ap.parse_args()
    url = "file://" + args.data
    if not os.path.exists(args.data):
        make_dataset(url, args.rows, image_format="jpg", sizes=(256, 256), aspect=(1.0, 1.0), progress=False)
    epoch(url, args.batch_size, {})  # warm: page cache, imports
    rates: dict[str, list[float]] = {name: [] for name, _ in CONFIGS}
    cpu: dict[str, list[float]] = {name: [] for name, _ in CONFIGS}
    for _ in range(args.repeats):
        for name, opts in CONFIGS:
            r, c = epoch(url, args.batch_size, opts)
            rates[name].append(r)
            cpu[name].append(c)
            print(f"{name}: {r:,.0f} samples/s, decode stage {c:.3f} ms CPU/sample", flush=True)
    base = statistics.median(rates[CONFIGS[0][0]])
    rows = []
    for name, _ in CONFIGS:
        med = statistics.median(rates[name])
        rows.append({"config": name, "samples_per_s": rates[name], "median": med, "vs_uint8": med / base,
                     "decode_stage_ms_per_sample": statistics.median(cpu[name])})  # fmt: skip
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        "rows": args.rows, "batch_size": args.batch_size, "repeats": args.repeats, "runs": rows,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"# Model-ready batches through AsyncLoader, decode='cpu', {os.cpu_count()} CPUs",
        "",
        f"{args.rows} photo-like 256×256 JPEG (q90) rows + lz4 masks, local disk, batch {args.batch_size}, "
        f"shuffled whole epochs, {args.repeats} alternating repeats, median.",
        "",
        "| images | samples/s (median) | vs uint8 | decode stage CPU ms/sample | each repeat |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{v:,.0f}" for v in r["samples_per_s"])
        lines.append(
            f"| {r['config']} | {r['median']:,.0f} | {r['vs_uint8']:.3f} | {r['decode_stage_ms_per_sample']:.3f} | {each} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
