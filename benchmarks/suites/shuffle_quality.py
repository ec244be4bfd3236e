"""How well shuffled is an epoch read in blocks? Two measures of the orders ``sampler.block_order`` makes.

    python benchmarks/suites/shuffle_quality.py [--rows 100000] [--batch 32] [--out benchmarks/results/large]

1. **Neighbour-difference entropy** (the measure Mosaic Streaming's simulator reports): the entropy, in
   bits, of the distribution of differences between the row numbers of consecutive samples of the order,
   and the same over the storage blocks they fall in (Mosaic's "shard indices"; here blocks of 64 rows),
   each as a fraction of a full shuffle's. A full shuffle spreads the differences over the whole dataset
   (1.0); reading rows in storage order concentrates them at +1 (near 0).
2. **Batch diversity**: the mean number of distinct neighbourhoods of ``L`` consecutive rows a batch
   draws from, as a fraction of a full shuffle's, for ``L`` of 64 and 1,024 rows. This is what
   training sees when neighbouring rows are alike (written in collection order: frames of one video,
   tiles of one slide, one class after another): at 1.0 a batch is as varied as a full shuffle's.

Both are averaged over 3 seeds; the full shuffle is ``block=1``. Pure computation, no I/O (seconds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asyncload.engine.sampler import block_order  # noqa: E402

#: (block, window) pairs measured; (1, 1) is the full shuffle
ORDERS = [(1, 1), (8, 1024), (16, 1024), (64, 1024), (64, 4096), (64, 16384), (256, 4096), (64, 64), (1024, 1024)]
NEIGHBOURHOODS = (64, 1024)
SEEDS = (0, 1, 2)


def diff_entropy(order: np.ndarray, unit: int = 1) -> float:
    """Entropy in bits of the differences between consecutive entries of ``order // unit``."""
    d = np.diff(order // unit)
    _, counts = np.unique(d, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def batch_diversity(order: np.ndarray, batch: int, hood: int) -> float:
    """Mean number of distinct ``hood``-row neighbourhoods per batch of ``order``."""
    m = len(order) // batch * batch
    groups = np.sort((order[:m] // hood).reshape(-1, batch), axis=1)
    return float(1 + (np.diff(groups, axis=1) != 0).sum(axis=1).mean())


def measure(rows: int, batch: int, block: int, window: int, seed: int) -> dict[str, float]:
    order = block_order(rows, block, window, np.random.default_rng([seed, 0]))
    out = {"entropy_rows": diff_entropy(order), "entropy_blocks": diff_entropy(order, 64)}
    for h in NEIGHBOURHOODS:
        out[f"diversity_{h}"] = batch_diversity(order, batch, h)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/large"))
    a = ap.parse_args(argv)
    raw = {
        (b, w): {
            k: float(np.mean([measure(a.rows, a.batch, b, w, s)[k] for s in SEEDS])) for k in measure(64, 8, 1, 1, 0)
        }
        for b, w in ORDERS
    }
    full = raw[(1, 1)]
    lines = [
        f"# Shuffle quality of block orders: {a.rows:,} rows, batches of {a.batch}, mean of {len(SEEDS)} seeds",
        "",
        "Each figure as a fraction of the full shuffle's (`benchmarks/suites/shuffle_quality.py`; 1.00 = as",
        "shuffled as a full shuffle by that measure). Entropy: of the differences between consecutive samples'",
        "row numbers, and between their 64-row blocks (Mosaic Streaming's simulator measure, over rows and",
        "shards). Diversity: distinct neighbourhoods of 64 / 1,024 consecutive rows per batch.",
        "",
        "| order (block rows / window rows) | entropy, rows | entropy, 64-row blocks | batch diversity, 64 | batch diversity, 1,024 |",
        "|---|---|---|---|---|",
    ]
    doc = {"rows": a.rows, "batch": a.batch, "seeds": list(SEEDS), "full_shuffle": full, "orders": []}
    for (b, w), m in raw.items():
        rel = {k: m[k] / full[k] for k in m}
        name = "full shuffle (block 1)" if b == 1 else f"{b} / {w:,}" + (" (no mixing)" if w <= b else "")
        lines.append(
            f"| {name} | {rel['entropy_rows']:.2f} | {rel['entropy_blocks']:.2f} | "
            f"{rel['diversity_64']:.2f} | {rel['diversity_1024']:.2f} |"
        )
        doc["orders"].append({"block": b, "window": w, "raw": m, "relative": rel})
    lines += [
        "",
        f"Full shuffle, absolute: entropy {full['entropy_rows']:.2f} bits (rows), {full['entropy_blocks']:.2f} bits "
        f"(blocks); {full['diversity_64']:.1f} and {full['diversity_1024']:.1f} distinct neighbourhoods per batch.",
    ]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "shuffle_quality.md").write_text("\n".join(lines) + "\n")
    (out / "shuffle_quality.json").write_text(json.dumps(doc, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
