"""What Deep Lake's reads alone can do on the bench's path: stored bytes (``get_bytes_async``) of images and
masks, shuffled or in storage order, ``req`` indices a request and ``inflight`` requests at once, no decode.

    python benchmarks/results/first_epoch/probes/raw_reads.py '[["shuffled", 64, 4, 64], ["sequential", 256, 4, 64]]' jpeg

Each case: ``[order, req, inflight, pool]``, order ``shuffled``, ``sequential``, ``blocks`` (runs of ``req``
rows in storage order, the runs shuffled), ``shuffled+warm`` (one row of every 1/40 of the set read first) or
``plain`` (shuffled, decoded by Deep Lake: ``get_async``, the plain column reader); run as root for the packet-level 50 ms testbed (else the TCP proxy).
"""

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from asyncload.runtime.polled import completions  # Deep Lake's Future.__await__ segfaults under GC
from benchmarks.testbeds import netem
from benchmarks.testbeds import world as W


def measure(url, creds, mode, req, inflight, pool):
    import deeplake

    deeplake.storage.set_concurrency(pool)
    c0 = time.process_time()  # after the import
    t0 = time.perf_counter()
    ds = deeplake.open_read_only(url, creds=creds)
    t_open = time.perf_counter() - t0
    n = len(ds)
    order = list(range(n))
    if mode.startswith("shuffled") or mode == "plain":
        random.Random(0).shuffle(order)
    groups = [order[i : i + req] for i in range(0, n, req)]
    if mode == "blocks":
        random.Random(0).shuffle(groups)
    im, mk = ds["images"], ds["masks"]
    first = [None]
    warm_s = None
    if mode.endswith("+warm"):

        async def warm():
            step = max(1, n // 40)
            await completions(*(c.get_bytes_async([i]) for i in range(0, n, step) for c in (im, mk)))

        asyncio.run(warm())
        warm_s = round(time.perf_counter() - t0, 3)

    async def main():
        sem = asyncio.Semaphore(inflight)

        async def one(g):
            async with sem:
                if mode == "plain":
                    a, b = await completions(im.get_async(g), mk.get_async(g))
                    nb = a.nbytes + b.nbytes
                else:
                    a, b = await completions(im.get_bytes_async(g), mk.get_bytes_async(g))
                    nb = sum(len(x) for x in a) + sum(len(x) for x in b)
                if first[0] is None:
                    first[0] = time.perf_counter() - t0
                return nb

        return sum(await asyncio.gather(*(one(g) for g in groups)))

    nbytes = asyncio.run(main())
    total = time.perf_counter() - t0
    return {
        "mode": mode,
        "req": req,
        "inflight": inflight,
        "pool": pool,
        "open_s": round(t_open, 3),
        "warm_s": warm_s,
        "first_s": round(first[0], 3),
        "total_s": round(total, 3),
        "rows_s": round(n / total),
        "MB": round(nbytes / 1e6, 1),
        "cpu_ms": round((time.process_time() - c0) / n * 1e3, 3),
    }


def each_case(call, spread: bool) -> None:
    """``call(url, creds, *case)`` (``spread``: the case's items as arguments, else the case whole) for each
        case of ``argv[1]`` (JSON), in a child forked in the client's namespace, on the dataset ``argv[2]``
        names (``jpeg``: 4,000 rows, ``png``: 1,000; ``ROWS``, ``DISTINCT`` in the environment for others) at 50 ms
    (``RTT``), or from local disk (``LOCAL=1``); one JSON line each."""
    cases = json.loads(sys.argv[1])
    name = sys.argv[2] if len(sys.argv) > 2 else "jpeg"
    with W.world(Path(__file__).resolve().parents[4] / "data" / "bench") as w:
        fmt, rows = ("jpg", 4000) if name == "jpeg" else ("png", 1000)
        rows = int(os.environ.get("ROWS", rows))  # a larger set: ROWS, and DISTINCT photos among them
        distinct = int(os.environ["DISTINCT"]) if os.environ.get("DISTINCT") else None
        w.add(name, W.DatasetSpec(rows=rows, image_format=fmt, size=256, distinct=distinct))
        w.set_rtt(float(os.environ.get("RTT", 50)))
        for c in cases:
            args = c if spread else [c]
            local = bool(os.environ.get("LOCAL"))  # the dataset's local copy instead
            url, creds = w.url(name, local), w.reader_creds(local)
            r = netem.fork_call(w.net.enter_client, call, url, creds, *args, timeout=120)
            print(json.dumps(r), flush=True)


if __name__ == "__main__":
    each_case(measure, spread=True)
