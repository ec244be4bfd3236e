"""Node-stable epochs measured on the sampler alone (``engine.nodes``): what a cluster fetches over many
epochs, how much each node keeps, how many blocks move when the node count changes, and how mixed a batch
is, against the global shuffle (``shuffle_scope="global"``).

    python benchmarks/suites/partition.py [--nodes 8] [--per-node 8] [--rows 200000] [--epochs 10]

A block (64 rows) is fetched once by every node that reads a row of it and does not have it yet (an
unbounded node store); "fetched" is the blocks fetched over all nodes and epochs per block of the dataset,
"on each node" the largest share of the dataset one node holds at the end. Mixing: distinct blocks in each
rank's batch of 32, as a fraction of a full shuffle's (``shuffle_quality``'s measure).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncload.engine.nodes import node_parts  # noqa: E402
from asyncload.engine.sampler import EpochSampler, Shard  # noqa: E402

BLOCK, WINDOW, BATCH = 64, 4096, 32


def fetched(nodes: int, per_node: int, rows: int, epochs: int, scope_nodes: int) -> dict[str, float]:
    """Blocks fetched over all nodes and epochs, per block of the dataset, and each node's share at the end."""
    world = nodes * per_node
    nb = -(-rows // BLOCK)
    have = np.zeros((nodes, nb), dtype=bool)
    total = 0
    mix = []
    for epoch in range(epochs):
        s = EpochSampler(rows, BATCH, shuffle=True, seed=0, shard=Shard(0, world), block=BLOCK, window=WINDOW,
                         nodes=scope_nodes)  # fmt: skip
        order = s.order(epoch)
        per_rank = s.rank_samples
        for node in range(nodes):
            pos = np.arange(node * per_node * per_rank, min((node + 1) * per_node * per_rank, len(order)))
            blocks = np.unique(order[pos] // BLOCK)
            total += int((~have[node, blocks]).sum())
            have[node, blocks] = True
        if epoch == 0:
            first = order[:per_rank]  # rank 0's rows: distinct blocks per batch
            mix = [
                len(np.unique(first[i : i + BATCH] // BLOCK)) / min(BATCH, nb)
                for i in range(0, len(first) - BATCH, BATCH)
            ]
    return {"fetched_x": total / nb, "largest_node_share": float(have.sum(axis=1).max() / nb),
            "distinct_blocks_per_batch_of_full_shuffle": float(np.mean(mix))}  # fmt: skip


def moved(before: int, after: int, rows: int) -> float:
    a, b = node_parts(rows, BLOCK, 0, before), node_parts(rows, BLOCK, 0, after)
    owner = np.full((2, -(-rows // BLOCK)), -1)
    for k, parts in enumerate((a, b)):
        for j, blocks in enumerate(parts):
            owner[k, blocks] = j
    return float(np.mean(owner[0] != owner[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "partition")
    a = ap.parse_args()
    res = {
        "args": vars(a) | {"out": str(a.out)},
        "node": fetched(a.nodes, a.per_node, a.rows, a.epochs, a.nodes),
        "global": fetched(a.nodes, a.per_node, a.rows, a.epochs, 1),
        "moved": {f"{x}->{y}": moved(x, y, a.rows) for x, y in ((2, 3), (4, 3), (8, 9), (8, 7))},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(res, indent=1))
    lines = [
        f"{a.nodes} nodes × {a.per_node} ranks, {a.rows:,} rows in blocks of {BLOCK}, window {WINDOW}, {a.epochs} "
        "epochs, seed 0; the sampler alone (an unbounded node store per node).",
        "",
        "| shuffle_scope | fetched over all nodes / dataset | largest share on one node | distinct blocks per batch (÷ batch) |",
        "|---|---|---|---|",
    ]
    for k in ("node", "global"):
        r = res[k]
        lines.append(
            f"| {k} | {r['fetched_x']:.3f} | {r['largest_node_share']:.3f} | {r['distinct_blocks_per_batch_of_full_shuffle']:.3f} |"
        )
    lines += ["", "Blocks that change node when the node count changes (fraction of the dataset): "
              + ", ".join(f"{k}: {v:.3f}" for k, v in res["moved"].items())]  # fmt: skip
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
