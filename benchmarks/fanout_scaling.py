"""Samples/s of ``FanoutEpoch`` with 1, 2, 4 worker processes against one in-process ``AsyncLoader``, with
CPU-heavy per-sample transforms; and what handing a batch to the parent copies.

Two transforms, because they scale differently:
- ``numpy``: a few ms of numpy per sample (float conversion, normalisation, flip, box blur, gamma). numpy
  releases the GIL in most of it, so the loader's CPU pool already spreads it over threads in one process;
- ``python``: a few ms of pure Python per sample (a histogram in a Python loop), which holds the GIL: one
  process runs it on one core, whatever its pool size. This is what processes are for.

Figures (samples/s):
- ``steady``: while every worker runs, start-up and the end-of-epoch drain left out (see ``run``);
- ``wall``: from creating the iterator to the last batch, so worker start-up (spawn imports torch and
  deeplake, ~2-3 s per worker) is included.

Copies: a batch of 32 256×256 RGB images + masks is collated into heap tensors (which pickling then moves
into shared memory: a second copy) or straight into shared memory (what fan-out workers do); the script
times the collation and the pickling of each.

Run: ``.venv/bin/python benchmarks/fanout_scaling.py [--path DIR] [--rows 2000] [--processes 1 2 4]``.
The dataset is made once at ``--path`` (2000 PNG rows take ~30 s). Figures depend on the machine's load:
the script prints the load average next to them.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import time
from pathlib import Path
from typing import Any

import numpy as np

from asyncload import AsyncLoader, DeepLakeSource, Shard, make_dataset
from asyncload.collate import collate_columns, set_allocator
from asyncload.fanout import FanoutEpoch
from asyncload.fanout.wire import _CREDITS, _shared_empty

_MEAN = np.array([0.45, 0.45, 0.45], np.float32)
_STD = np.array([0.25, 0.25, 0.25], np.float32)


def numpy_heavy(sample: dict[str, Any]) -> dict[str, Any]:
    """A few ms of numpy on one 256×256×3 sample."""
    img = sample["images"].astype(np.float32) / 255.0
    img = (img - _MEAN) / _STD
    img = img[:, ::-1]
    blur = img.copy()
    blur[1:-1, 1:-1] = (img[:-2, 1:-1] + img[2:, 1:-1] + img[1:-1, :-2] + img[1:-1, 2:] + img[1:-1, 1:-1]) * 0.2
    return {"images": np.ascontiguousarray(blur.transpose(2, 0, 1)), "masks": sample["masks"].astype(np.int64)}


def python_heavy(sample: dict[str, Any]) -> dict[str, Any]:
    """A few ms of pure Python (holds the GIL) on one sample: a histogram of every other pixel."""
    hist = [0] * 256
    for v in sample["images"][::2, ::2].reshape(-1).tolist():
        hist[v] += 1
    return {"images": np.array(sample["images"]), "masks": np.array(sample["masks"]), "hist": np.array(hist)}


TRANSFORMS = {"numpy": numpy_heavy, "python": python_heavy}


def per_sample_ms(fn: Any, src: DeepLakeSource) -> float:
    ds = src.handle()
    sample = {c: np.array(ds[0][c]) for c in src.columns} | {"index": 0}
    fn(sample)
    t0 = time.perf_counter()
    for _ in range(50):
        fn(sample)
    return (time.perf_counter() - t0) / 50 * 1e3


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have been joined (the workers, after close)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run(src: DeepLakeSource, kwargs: dict[str, Any], processes: int) -> tuple[float, float, float, int]:
    """(steady samples/s, wall samples/s, CPU ms per sample, samples) for one epoch; ``processes=0``: one
    AsyncLoader. CPU includes the workers' start-up (imports) and every copy; unlike samples/s it barely
    depends on what else the machine runs.

    Steady: batches between the first batch of the last worker to start (batch ``K - 1`` in order) and
    the last batch before the read-ahead buffers start to drain at the end of the epoch. Inside that
    window every buffer stays full, so what comes out is what the workers make; outside it, batches
    read ahead during start-up would inflate the figure."""
    batch = kwargs["batch_size"]
    ahead = kwargs["prefetch"] + math.ceil(kwargs["concurrency"] / batch) + 1 + (_CREDITS if processes else 0)
    t0, c0 = time.perf_counter(), cpu_seconds()
    if processes == 0:
        it: Any = iter(AsyncLoader(src, **kwargs))
    else:
        it = FanoutEpoch(src, kwargs, Shard(), 0, processes)
    first, last = max(1, processes) - 1, len(it) - ahead * max(1, processes) - 1
    assert first < last, f"the epoch ({len(it)} batches) is too short to see a steady state: pass more --rows"
    n = 0
    marks: dict[int, tuple[float, int]] = {}
    with it:
        for j, b in enumerate(it):
            n += len(b["index"])
            if j in (first, last):
                marks[j] = (time.perf_counter(), n)
    end = time.perf_counter()
    (ta, na), (tb, nb) = marks[first], marks[last]
    return (nb - na) / (tb - ta), n / (end - t0), (cpu_seconds() - c0) / n * 1e3, n


def measure_copies(src: DeepLakeSource, batch: int = 32, repeat: int = 20) -> None:
    """Collate a batch into heap tensors or into shared memory, then pickle it for the parent."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's reductions (as in a worker)

    ds = src.handle()
    parts = [{c: np.stack([np.array(ds[i][c]) for i in range(batch)]) for c in src.columns}]
    idx = list(range(batch))
    mb = sum(p.nbytes for p in parts[0].values()) / 2**20
    print(f"\ncopies: one batch of {batch} samples, {mb:.1f} MiB; min (median) of {repeat}")
    for name, alloc in (("heap (share on pickle)", None), ("shared memory (fan-out)", _shared_empty)):
        set_allocator(alloc)
        tc, tp = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            b = collate_columns(src.columns, parts, idx, True)
            t1 = time.perf_counter()
            shared_before = b["images"].is_shared()
            ForkingPickler.dumps(b)
            t2 = time.perf_counter()
            tc.append(t1 - t0)
            tp.append(t2 - t1)
            del b
        tt = np.add(tc, tp)
        print(
            f"  {name:24s} collate {min(tc) * 1e3:5.2f} ({np.median(tc) * 1e3:5.2f}) ms"
            f"  pickle {min(tp) * 1e3:5.2f} ({np.median(tp) * 1e3:5.2f}) ms"
            f"  both {tt.min() * 1e3:5.2f} ({np.median(tt) * 1e3:5.2f}) ms"
            f"  ({'already shared' if shared_before else 'moved to shared memory while pickling'})"
        )
    set_allocator(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--path", default="/tmp/asyncload-bench/seg2000")
    ap.add_argument("--rows", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--transforms", nargs="+", default=list(TRANSFORMS), choices=list(TRANSFORMS))
    args = ap.parse_args()

    path = Path(args.path)
    if not path.exists():
        t0 = time.perf_counter()
        make_dataset(str(path), args.rows, progress=False)
        print(f"made {args.rows} rows of 256x256 PNG at {path} in {time.perf_counter() - t0:.1f}s")
    src = DeepLakeSource(str(path))
    print(f"{len(src)} rows at {path}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")

    measure_copies(src)

    for name in args.transforms:
        fn = TRANSFORMS[name]
        kwargs = {
            "batch_size": args.batch_size, "shuffle": True, "seed": 0, "transform": fn,
            "prefetch": 2, "concurrency": 32,
        }  # fmt: skip
        print(f"\ntransform {name!r}: {per_sample_ms(fn, src):.1f} ms per sample in one thread")
        print(f"  {'':14s} {'steady':>10s} {'wall':>10s} {'CPU/sample':>11s}   load")
        base = None
        for k in [0, *args.processes]:
            steady, wall, cpu_ms, n = run(src, kwargs, k)
            assert n == len(src), n
            base = base or steady
            label = "AsyncLoader" if k == 0 else f"processes={k}"
            print(
                f"  {label:14s} {steady:8.0f}/s {wall:8.0f}/s {cpu_ms:8.2f} ms   {os.getloadavg()[0]:5.2f}"
                f"   steady x{steady / base:.2f}"
            )


if __name__ == "__main__":
    main()
