"""The decode stage as the loader runs it: two decode threads (1,920 JPEG + lz4 pairs of the bench dataset,
batches of 32) handing batches to a consumer thread that drops each one when it takes the next, with batch
memory from numpy's heap as before (``before``) and from ``runtime.alloc``'s spares (``after``), alternated
six times: decode-thread CPU per sample, their page faults per sample, and the batches given a spare. Run
from the repository root: ``.venv/bin/python benchmarks/results/cpu/batch_spares.py``."""

import asyncio
import queue
import resource
import statistics
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, ".")
from asyncload.engine.options import LoaderOptions
from asyncload.image import decode as D
from asyncload.runtime import alloc
from asyncload.sources.deeplake import DeepLakeSource

B = 32
idx = list(range(0, 4000, 2))[:1920]
source = DeepLakeSource("data/bench/photos-4000-jpg")
stage = D.decode_stage(source, LoaderOptions())
# the stored bytes as the loader's reads return them (``Source.read`` with both columns raw)
read = asyncio.run(source.read(idx, frozenset({"images", "masks"})))
imgs, masks = read["images"], read["masks"]


def before(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The allocator before this change: a new numpy array per batch."""
    return torch.from_numpy(np.empty(shape, alloc._NUMPY_DTYPES[dtype]))


def epoch() -> tuple[float, float]:
    q: queue.Queue = queue.Queue(maxsize=6)
    cpu, faults = [0.0, 0.0], [0, 0]

    def consumer() -> None:
        held = None
        while (x := q.get()) is not None:
            held = x  # the previous batch goes when the next one is taken, as in a training loop
        del held

    def decoder(k: int) -> None:
        c = time.thread_time()
        f = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for s in range(k * B, len(idx), 2 * B):
            q.put(
                D.run(
                    stage, ["images", "masks"], {"images": imgs[s : s + B], "masks": masks[s : s + B]}, idx[s : s + B]
                )
            )
        cpu[k] = time.thread_time() - c
        faults[k] = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f

    t = threading.Thread(target=consumer)
    t.start()
    workers = [threading.Thread(target=decoder, args=(k,)) for k in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    q.put(None)
    t.join()
    return sum(cpu) / len(idx) * 1e6, sum(faults) / len(idx)


res: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
reused = fresh = 0
for _ in range(6):
    for name, a in (("before", before), ("after", None)):
        alloc.set_allocator(a)
        r0, f0 = alloc._spares.reused, alloc._spares.fresh
        res[name].append(epoch())
        if name == "after":
            reused += alloc._spares.reused - r0
            fresh += alloc._spares.fresh - f0
        alloc.release_spares()
for name, rs in res.items():
    print(
        f"{name}: decode CPU µs/sample median {statistics.median(r[0] for r in rs):.0f} "
        f"(runs {', '.join(f'{r[0]:.0f}' for r in rs)}); page faults/sample median {statistics.median(r[1] for r in rs):.2f}"
    )
print(f"after: {reused} batch tensors given a spare, {fresh} new")
