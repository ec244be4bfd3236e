"""Which blocks the node store should keep when the dataset is larger than its limit: measured on the
sampler's real block orders, epoch after epoch.

Policies, for a store that holds ``fraction`` of a dataset's blocks:
- ``lru``: every fetched block is written; the least recently used one is removed to make room;
- ``farthest``: every fetched block is written; the block whose next use (in this and the next epochs'
  known orders) is farthest away is removed (Belady's rule: the best any evicting policy can do);
- ``resident``: the first blocks that fit are kept for good; the rest are read from the store and not
  written (what ``nodestore`` does).

Reports the hit rate over epochs 2..E and the bytes written per epoch (as blocks), for several fractions.
A block is one unit (the store keeps whole bins; rows of a block come and go together).

    python benchmarks/suites/nodestore_policy.py --blocks 1563 --epochs 10 --out benchmarks/results/nodestore
"""

from __future__ import annotations

import argparse
import json
from collections import OrderedDict
from pathlib import Path

import numpy as np

from asyncload.engine.sampler import EpochSampler


def block_sequence(blocks: int, block: int, epochs: int, seed: int) -> list[list[int]]:
    """Each epoch's blocks in the order their first row comes (the order a store fetches them)."""
    s = EpochSampler(blocks * block, 32, shuffle=True, seed=seed, block=block, window=4096)
    out = []
    for e in range(epochs):
        seen: dict[int, None] = {}
        for i in s.order(e):
            seen.setdefault(int(i) // block, None)
        out.append(list(seen))
    return out


def simulate(seq: list[list[int]], capacity: int, policy: str) -> tuple[list[float], list[int]]:
    flat = [b for ep in seq for b in ep]
    per_epoch = [len(ep) for ep in seq]
    nxt = [0] * len(flat)  # position of each access's next use of the same block
    last: dict[int, int] = {}
    for p in range(len(flat) - 1, -1, -1):
        nxt[p] = last.get(flat[p], 1 << 60)
        last[flat[p]] = p
    hits, writes = [], []
    lru: OrderedDict[int, None] = OrderedDict()
    next_use: dict[int, int] = {}
    p = 0
    for n in per_epoch:
        h = w = 0
        for _ in range(n):
            b = flat[p]
            if b in lru:
                h += 1
                lru.move_to_end(b)
            elif policy == "resident":
                if len(lru) < capacity:
                    lru[b] = None
                    w += 1
            else:
                if len(lru) >= capacity:
                    if policy == "lru":
                        lru.popitem(last=False)
                    else:
                        victim = max(lru, key=lambda x: next_use[x])
                        if next_use[victim] < nxt[p]:  # the new block is needed later than any kept one
                            victim = -1
                        if victim >= 0:
                            del lru[victim]
                if len(lru) < capacity:
                    lru[b] = None
                    w += 1
            next_use[b] = nxt[p]
            p += 1
        hits.append(h / n)
        writes.append(w)
    return hits, writes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=1563)  # the 3.6 GB / 100,000-row bench set in 64-row blocks
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    seq = block_sequence(a.blocks, a.block, a.epochs, a.seed)
    rows = []
    for fraction in (0.25, 0.5, 0.75, 0.9):
        cap = int(fraction * a.blocks)
        for policy in ("lru", "farthest", "resident"):
            hits, writes = simulate(seq, cap, policy)
            later = hits[1:]
            rows.append({
                "fraction": fraction, "policy": policy, "hit_rate_epochs_2_on": round(float(np.mean(later)), 4),
                "blocks_written_per_later_epoch": round(float(np.mean(writes[1:])), 1),
            })  # fmt: skip
    lines = ["| store holds | policy | hit rate, epochs 2+ | blocks written per later epoch |", "|---|---|---|---|"]
    lines += [
        f"| {r['fraction']:.0%} | {r['policy']} | {r['hit_rate_epochs_2_on']:.3f} | {r['blocks_written_per_later_epoch']:,.0f} |"
        for r in rows
    ]
    print("\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "policy.json").write_text(json.dumps({"args": vars(a) | {"out": str(a.out)}, "rows": rows}, indent=1))
        (a.out / "policy.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
