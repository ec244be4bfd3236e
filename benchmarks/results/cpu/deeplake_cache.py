"""Deep Lake's in-memory cache (``deeplake._deeplake._create_global_cache``) against how rows are read: bytes
on loopback, CPU and RSS of one whole read of a dataset from SeaweedFS on loopback, in a fresh process per
cache size. ``blocks``: runs of 32 contiguous rows in a shuffled order (asyncload's reads); ``scattered``: 32
shuffled rows a request (a plain shuffled reader's). Loopback counts each byte on every hop inside
SeaweedFS too, so compare the figures with each other only.

    .venv/bin/python benchmarks/results/cpu/deeplake_cache.py data/bench/photos-1000-png 0 67108864 268435456
"""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _lo_bytes() -> int:
    with open("/proc/net/dev") as f:
        return next(int(ln.split(":")[1].split()[0]) for ln in f if ln.strip().startswith("lo:"))


def child(size: int, url: str, creds: dict[str, str], how: str) -> None:
    import deeplake

    if size:
        deeplake._deeplake._create_global_cache(size)
    ds = deeplake.open_read_only(url, creds=creds)
    n = len(ds)
    rng = random.Random(0)
    if how == "blocks":
        starts = list(range(0, n, 32))
        rng.shuffle(starts)
        requests = [list(range(a, min(a + 32, n))) for a in starts]
    else:
        order = list(range(n))
        rng.shuffle(order)
        requests = [sorted(order[a : a + 32]) for a in range(0, n, 32)]
    b0, c0 = _lo_bytes(), time.process_time()
    for rows in requests:
        for col in ds.schema.columns:
            ds[col.name].get_bytes(rows)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"{how:9s} cache {size >> 20:4d} MB: {(_lo_bytes() - b0) / 1e6:,.0f} MB on loopback, "
          f"CPU {time.process_time() - c0:.2f} s, peak RSS {peak} MB")  # fmt: skip


def main(local: str, sizes: list[int]) -> None:
    sys.path.insert(0, str(ROOT))
    from harness.seaweed import SeaweedServer

    with SeaweedServer() as srv:
        srv.create_bucket("cachetest")
        srv.put_tree("cachetest", "set", Path(local).resolve())
        creds = json.dumps(srv.creds())
        for how in ("blocks", "scattered"):
            for size in sizes:
                subprocess.run(
                    [sys.executable, __file__, "--child", str(size), "s3://cachetest/set", creds, how], check=True
                )


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        child(int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4]), sys.argv[5])
    else:
        main(sys.argv[1], [int(s) for s in sys.argv[2:]] or [0])
