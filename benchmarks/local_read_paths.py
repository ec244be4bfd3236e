"""Read paths on a local PNG dataset: per-row vs column reads, concurrency 1/8/64/256, vs sequential.

    python benchmarks/local_read_paths.py [--rows 2000] [--repeats 3] [--out benchmarks/results]

Every figure comes from the same run on the same dataset: the sequential ``ds[i][col]`` loop first, then
asyncload over whole epochs; samples/s is the median over ``--repeats`` epochs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import deeplake

from asyncload import AsyncLoader, DeepLakeSource, make_dataset
from asyncload.measure import Measurement, measure, sequential, table


def median_of(runs: list[Measurement]) -> Measurement:
    runs = sorted(runs, key=lambda m: m.samples_per_s)
    return runs[len(runs) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/bench-png-2000")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--concurrency", default="1,8,64,256")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()

    url = "file://" + os.path.abspath(args.data)
    if not deeplake.exists(url) or len(deeplake.open_read_only(url)) != args.rows:
        make_dataset(url, args.rows, overwrite=True)
    src = DeepLakeSource(url)
    rows: list[Measurement] = []
    base = median_of(
        [measure("sequential ds[i][col]", sequential(url, src.columns), count=lambda _: 1) for _ in range(args.repeats)]
    )
    rows.append(base)
    for mode in ("row", "column"):
        for c in (int(x) for x in args.concurrency.split(",")):
            loader = AsyncLoader(src, args.batch_size, concurrency=c, read_mode=mode)
            runs = [measure(f"asyncload {mode}, concurrency {c}", loader) for _ in range(args.repeats)]
            rows.append(median_of(runs))
            print(f"{rows[-1].name}: {rows[-1].samples_per_s:,.0f} samples/s", file=sys.stderr)
    md = table(rows, base)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    meta = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}, deeplake {deeplake.__version__}",
        "dataset": f"{args.rows} rows, 256x256x3 PNG images + 256x256 lz4 masks, local disk",
        "batch_size": args.batch_size,
        "repeats": args.repeats,
    }
    with open(os.path.join(args.out, "local_read_paths.json"), "w") as f:
        json.dump({**meta, "results": [m.as_dict() for m in rows]}, f, indent=2)
    with open(os.path.join(args.out, "local_read_paths.md"), "w") as f:
        f.write(
            f"# Local read paths\n\n{meta['machine']}; {meta['dataset']}; batch {args.batch_size}; median of {args.repeats}.\n\n{md}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
