"""Page faults and CPU of one 32x256x256x3 uint8 batch buffer, allocated and written on one thread and
freed on another (as the decode stage and the consumer do): numpy against torch.empty. ``nohuge`` turns
off numpy's huge-page request. Run: python alloc_faults.py huge|nohuge"""

import queue
import resource
import sys
import threading
import time

import numpy as np
import torch

if sys.argv[1] == "nohuge":
    np._core.multiarray._set_madvise_hugepage(False)


def run(make, n=200):
    q = queue.Queue(maxsize=4)

    def consumer():
        while (x := q.get()) is not None:
            del x

    t = threading.Thread(target=consumer)
    t.start()
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0 = time.process_time()

    def producer():
        for _ in range(n):
            a = make()
            a.fill(1) if hasattr(a, "fill") else a.fill_(1)
            q.put(a)
        q.put(None)

    p = threading.Thread(target=producer)
    p.start()
    p.join()
    t.join()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0) / n, (time.process_time() - c0) / n * 1e3


for name, make in [
    ("np 32", lambda: np.empty((32, 256, 256, 3), np.uint8)),
    ("torch 32", lambda: torch.empty((32, 256, 256, 3), dtype=torch.uint8)),
]:
    print(sys.argv[1], name, "faults/alloc {:.0f}  ms/alloc {:.2f}".format(*run(make)))
