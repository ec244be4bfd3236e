"""The node store's own cost per row, with no network and no loader: a write (``Shelf.put``, parts of 64
rows), a look-up in the index (requests of 32 rows, what a warm epoch asks) and a read back from the parts
(checksum and decode), each in microseconds per row, the page cache warm.

    python benchmarks/suites/nodestore_cost.py [--rows 6400] [--repeat 3] [--out FILE.json]

Two kinds of rows: ``bytes`` (a 20 KB image and a 5 KB mask, stored bytes: no pickle) and ``pickled`` (the
same plus a small dict per row, which the store pickles and, since the store became private, signs with
an HMAC-SHA256 and checks before unpickling). Run it against another checkout of asyncload (``PYTHONPATH``)
to compare: it imports the store from ``asyncload.nodestore`` or, before the move, from
``asyncload.sources.nodestore``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

try:
    from asyncload.nodestore import NodeStore
except ImportError:  # (a checkout from before the store had its own package)
    from asyncload.sources.nodestore import NodeStore  # type: ignore[no-redef]


def once(rows: int, pickled: bool) -> dict[str, float]:
    rng = np.random.default_rng(0)
    images = [rng.bytes(20_000) for _ in range(64)]
    masks = [rng.bytes(5_000) for _ in range(64)]
    meta = [{"row": i, "boxes": [[i, 2, 3, 4]] * 3, "label": "car"} for i in range(64)]
    cols = ["images@b", "masks@b"] + (["meta@a"] if pickled else [])
    with tempfile.TemporaryDirectory() as d:
        store = NodeStore(Path(d) / "store", 1 << 40)
        shelf = store.shelf("bench|v1", "bench")
        assert shelf is not None
        c0, t0 = time.process_time(), time.perf_counter()
        for lo in range(0, rows, 64):
            values: dict[str, Any] = {"images@b": images, "masks@b": masks}
            if pickled:
                values["meta@a"] = meta
            assert shelf.put(list(range(lo, lo + 64)), values)
        c1, t1 = time.process_time(), time.perf_counter()
        found = [shelf.lookup(list(range(lo, min(lo + 32, rows))), cols) for lo in range(0, rows, 32)]
        c2, t2 = time.process_time(), time.perf_counter()
        n = 0
        for f in found:
            for c in cols:
                n += len(shelf.get([e[c] for e in f.values()]))
        c3, t3 = time.process_time(), time.perf_counter()
        assert n == rows * len(cols)
        shelf.release()
        if hasattr(store, "close"):
            store.close()
    us = 1e6 / rows
    return {
        "put_us_cpu": (c1 - c0) * us, "lookup_us_cpu": (c2 - c1) * us, "get_us_cpu": (c3 - c2) * us,
        "put_us": (t1 - t0) * us, "lookup_us": (t2 - t1) * us, "get_us": (t3 - t2) * us,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=6400)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    out: dict[str, Any] = {"rows": args.rows, "repeat": args.repeat, "store": NodeStore.__module__}
    for kind in ("bytes", "pickled"):
        runs = [once(args.rows, kind == "pickled") for _ in range(args.repeat)]
        out[kind] = {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}
    print(json.dumps(out))
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
