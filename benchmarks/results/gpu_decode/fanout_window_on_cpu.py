"""CPU-side check of the fan-out's device threads (see README.md here): 2 spawn workers ship packed batches
(``decode="cuda"``) and the parent's device stage runs on ``device="cpu"``; samples/s per epoch.
``python benchmarks/results/gpu_decode/fanout_window_on_cpu.py <label>`` from the repository root."""

import dataclasses
import sys
import time

from asyncload import DeepLakeSource
from asyncload.engine.sampler import Shard
from asyncload.processes.fanout import FanoutIterator, WorkerPool

URL = "data/bench/photos-4000-jpg"
OPTIONS = {"batch_size": 32, "decode": "cuda", "shuffle": True, "seed": 0}

if __name__ == "__main__":
    pool = WorkerPool(DeepLakeSource(URL), OPTIONS, Shard(), 2, context="spawn")
    pool.gpu_stage = dataclasses.replace(pool.gpu_stage, device="cpu")
    for epoch in range(3):
        t, n = time.perf_counter(), 0
        with FanoutIterator(pool, epoch) as it:
            for batch in it:
                n += len(batch["images"])
        print(sys.argv[1] if len(sys.argv) > 1 else "", epoch, f"{n / (time.perf_counter() - t):.0f}/s", flush=True)
    pool.close()
