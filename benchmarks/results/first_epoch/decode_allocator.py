"""The decode stage on one thread (1,920 JPEG + lz4 pairs of the bench dataset, batches of 32, a consumer
thread dropping them), with torch.empty batch buffers (old) and the default allocator (new), alternated
six times: thread CPU per sample and page faults. Run from the repository root."""

import queue
import resource
import sys
import threading
import time

import torch

sys.path.insert(0, ".")
import asyncload.engine.collate as C
from asyncload.engine.options import LoaderOptions
from asyncload.image import decode as D
from asyncload.sources.deeplake import DeepLakeSource

src = DeepLakeSource("data/bench/photos-4000-jpg")
src.open()
ds = src.handle()
idx = list(range(0, 4000, 2))[:1920]
imgs = ds["images"].get_bytes(idx)
masks = ds["masks"].get_bytes(idx)
stage = D.decode_stage(src, LoaderOptions())
B = 32


def al():
    q = queue.Queue(maxsize=6)

    def consumer():
        while (x := q.get()) is not None:
            del x

    t = threading.Thread(target=consumer)
    t.start()
    c = time.thread_time()
    f = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for s in range(0, len(idx), B):
        q.put(D.run(stage, ["images", "masks"], {"images": imgs[s : s + B], "masks": masks[s : s + B]}, idx[s : s + B]))
    el = time.thread_time() - c
    f = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f
    q.put(None)
    t.join()
    return el / len(idx) * 1e6, f / len(idx)


new = C.heap_empty


def old(s, d):
    return torch.empty(s, dtype=d)


res = {"old": [], "new": []}
for _ in range(6):
    for name, a in (("old", old), ("new", new)):
        C.set_allocator(a)
        res[name].append(al())
for k, v in res.items():
    print(
        k,
        "us/sample",
        [round(x) for x, _ in v],
        "median",
        round(sorted(x for x, _ in v)[3]),
        "faults/sample",
        round(sum(f for _, f in v) / len(v), 1),
    )
