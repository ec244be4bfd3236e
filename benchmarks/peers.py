"""The readers the WAN benchmark compares, and how one of them is measured in a fresh process.

Every reader gets the same dataset URL, the same index order (``order``: sequential or one fixed
permutation) and yields batches of decoded images and masks as torch tensors (one copy per sample, as a
training step needs them). The peers are written the way a user would write them:

- ``sync``: a map-style Dataset (``baselines.SyncSegDataset``: ``ds[i]["images"]``, ``ds[i]["masks"]``)
  through a DataLoader with 0/2/4 workers; ``pytorch``: Deep Lake's ``ds.pytorch()`` the same way;
- ``recipe``: the published asyncio recipe (``recipe.py``), which reads in its own order (sequential);
- ``spdl``: an SPDL 0.8 pipeline, per-row ``get_async`` of image and mask at concurrency 64, storage pool 64;
- ``column``: a plain reader, :func:`column_batches`, ~30 lines: 64 indices per ``get_async``, 4 in flight,
  storage pool 64; ``ceiling`` is the same reader on a local copy;
- ``asyncload``: ``AsyncLoader(DeepLakeSource(url, creds=...), batch_size=32, shuffle=...)`` with
  whatever options the run names (none: the defaults).

:func:`measure_reader` runs in a child process forked from a server that imported torch and Deep Lake
but never read (so each repetition is a fresh process with a cold, freshly opened dataset, without paying
~3 s of imports); the child first moves into the client's network namespace.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

BATCH = 32
_LIVE: dict[str, Any] = {}  # the AsyncLoader being measured, for its stats() at the end
#: DataLoader workers are forked (Linux's default): no read is in flight when the DataLoader starts them,
#: and spawn would add ~5-10 s of imports per run on 2 cores, which the warm-up excludes anyway.
WORKER_START = "fork"


def _open(url: str, creds: dict[str, str] | None) -> Any:
    import deeplake

    return deeplake.open_read_only(url, creds=creds) if creds else deeplake.open_read_only(url)


def _tensors(images: Any, masks: Any) -> dict[str, torch.Tensor]:
    """Stack into new writable tensors: the one copy every reader makes."""
    return {"images": torch.from_numpy(np.stack(images)), "masks": torch.from_numpy(np.stack(masks))}


def column_batches(
    url: str,
    creds: dict[str, str] | None,
    order: list[int],
    request: int = 64,
    inflight: int = 4,
    pool_after_open: bool = False,
) -> Iterator[dict[str, torch.Tensor]]:
    """The plain reader: column ``get_async`` of ``request`` indices per column, ``inflight`` requests
    in flight on a loop thread, in order, through a bounded queue."""
    import deeplake

    if not pool_after_open:
        deeplake.storage.set_concurrency(64)
    ds = _open(url, creds)
    if pool_after_open:  # the diagnosis: does the pool size still change connections once a dataset is open?
        deeplake.storage.set_concurrency(64)
    out: queue.Queue[Any] = queue.Queue(maxsize=inflight)

    async def fetch(idx: list[int]) -> dict[str, torch.Tensor]:
        images, masks = await asyncio.gather(ds["images"].get_async(idx), ds["masks"].get_async(idx))
        return _tensors(images, masks)

    async def produce() -> None:
        pending: list[asyncio.Task[Any]] = []
        for start in range(0, len(order), request):
            pending.append(asyncio.create_task(fetch(order[start : start + request])))
            if len(pending) >= inflight:
                out.put(await pending.pop(0))
        for task in pending:
            out.put(await task)
        out.put(None)

    threading.Thread(target=asyncio.run, args=(produce(),), daemon=True).start()
    while (batch := out.get()) is not None:
        yield batch


def spdl_batches(
    url: str, creds: dict[str, str] | None, order: list[int], concurrency: int = 64
) -> Iterator[dict[str, torch.Tensor]]:
    """SPDL 0.8: source of indices → async per-row fetch (image and mask) → batches of 32 → collate."""
    import deeplake
    from spdl.pipeline import PipelineBuilder

    deeplake.storage.set_concurrency(64)
    ds = _open(url, creds)

    async def fetch(i: int) -> tuple[Any, Any]:
        row = ds[i]
        return tuple(await asyncio.gather(row.get_async("images"), row.get_async("masks")))

    def collate(rows: list[tuple[Any, Any]]) -> dict[str, torch.Tensor]:
        return _tensors([r[0] for r in rows], [r[1] for r in rows])

    pipeline = (
        PipelineBuilder()
        .add_source(order)
        .pipe(fetch, concurrency=concurrency, output_order="input")
        .aggregate(BATCH)
        .pipe(collate)
        .add_sink(4)
        .build(num_threads=2)
    )
    with pipeline.auto_stop():
        yield from pipeline.get_iterator(timeout=120)


def dataloader_batches(
    kind: str, url: str, creds: dict[str, str] | None, order: list[int], workers: int
) -> Iterator[Any]:
    """A map-style dataset (``sync``: ours; ``pytorch``: ``ds.pytorch()``) through a DataLoader."""
    from baselines import SyncSegDataset, deeplake_pytorch
    from torch.utils.data import DataLoader

    ds = SyncSegDataset(url, creds) if kind == "sync" else deeplake_pytorch(url, creds)
    return iter(
        DataLoader(
            ds,
            batch_size=BATCH,
            sampler=order,
            num_workers=workers,
            multiprocessing_context=WORKER_START if workers else None,
        )
    )


def recipe_batches(url: str, creds: dict[str, str] | None, limit: int) -> Iterator[Any]:
    from recipe import RecipeAsyncDataset
    from torch.utils.data import DataLoader

    return iter(DataLoader(RecipeAsyncDataset(_open(url, creds), limit), batch_size=BATCH, num_workers=0))


def asyncload_batches(url: str, creds: dict[str, str] | None, shuffle: bool, options: dict[str, Any]) -> Iterator[Any]:
    from asyncload import AsyncLoader, DeepLakeSource

    source_opts = {k: options[k] for k in ("storage_concurrency",) if k in options}
    loader_opts = {k: v for k, v in options.items() if k not in source_opts}
    src = DeepLakeSource(url, creds=creds, **source_opts)
    loader = AsyncLoader(src, batch_size=BATCH, shuffle=shuffle, **loader_opts)
    _LIVE["asyncload"] = loader
    return iter(loader)


def batches(spec: dict[str, Any], order: list[int], limit: int) -> Iterator[Any]:
    """The iterator a spec names (see the module docstring)."""
    kind, url, creds = spec["reader"], spec["url"], spec.get("creds")
    if kind in ("sync", "pytorch"):
        return dataloader_batches(kind, url, creds, order, spec["workers"])
    if kind == "recipe":
        return recipe_batches(url, creds, limit)
    if kind == "spdl":
        return spdl_batches(url, creds, order)
    if kind in ("column", "ceiling", "column_late"):
        return column_batches(url, creds, order, pool_after_open=kind == "column_late")
    if kind == "asyncload":
        return asyncload_batches(url, creds, spec["order"] == "shuffled", spec.get("options", {}))
    raise ValueError(f"unknown reader {kind!r}")


def _count(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(next(iter(v for k, v in batch.items() if k != "index")))
    if isinstance(batch, (list, tuple)):
        return len(batch[0])
    return len(batch)


def _stat_cpu_s(path: str, reaped: bool = False) -> float:
    """CPU seconds (user + system) in a ``/proc/.../stat`` file, with reaped children's if ``reaped``."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11 : 15 if reaped else 13]) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int, reaped: bool = False) -> float:
    """CPU seconds (user + system) of one process from /proc, with its reaped children's if ``reaped``."""
    try:
        return _stat_cpu_s(f"/proc/{pid}/stat", reaped)
    except (OSError, IndexError, ValueError):
        return 0.0


def tree_cpu_s(pid: int | None, reaped: bool = False) -> float:
    """CPU seconds of a process and its live descendants (see ``proc_cpu_s``); 0 for no process."""
    from asyncload.measure import _children

    total, todo = 0.0, [pid] if pid else []
    while todo:
        p = todo.pop()
        total += proc_cpu_s(p, reaped)
        todo += _children(p)
    return total


def net_counters() -> dict[str, int]:
    """This network namespace's TCP counters (``/proc/net/snmp``: connections opened, segments
    retransmitted) and bytes received on its non-loopback interfaces (``/proc/net/dev``). Only one
    measured process runs in the client namespace at a time, so a delta over a run is that run's."""
    with open("/proc/net/snmp") as f:
        head, values = [line.split() for line in f if line.startswith("Tcp:")][:2]
    tcp = dict(zip(head[1:], map(int, values[1:]), strict=True))
    with open("/proc/net/dev") as f:
        rx = sum(int(line.split(":")[1].split()[0]) for line in f if ":" in line and line.split(":")[0].strip() != "lo")
    return {"tcp_opens": tcp["ActiveOpens"], "tcp_retrans_segs": tcp["RetransSegs"], "rx_bytes": rx}


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of this process's live threads, grouped by kind: Deep Lake's storage/decode pool
    (``B_<n>``), its other named threads, and the Python threads (the loop, the CPU pool, the consumer)."""
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            cpu = _stat_cpu_s(f"/proc/self/task/{tid}/stat")
        except OSError:
            continue
        group = "deeplake B_*" if name.startswith("B_") else ("python threads" if name == "python" else name)
        out[group] = out.get(group, 0.0) + cpu
    return out


#: What an asyncload run reports from ``loader.stats()`` (``asyncload_<name>``).
_STATS = (
    "concurrency", "read_p50_ms", "read_p99_ms", "consumer_wait_s", "requests", "hedges", "hedges_won",
    "samples_read", "samples_yielded",
)  # fmt: skip


def measure_reader(spec: dict[str, Any]) -> dict[str, Any]:
    """Open and read one first epoch (every row of ``rows``, in ``order``), or as much of it as comes
    within ``epoch_s`` seconds after the first batch; report what it cost.

    - ``samples_per_s``: from the first batch to the last (the samples after the first batch over that
      time), as ``asyncload.measure`` counts; time to first batch is reported on its own.
    - ``run_samples_per_s``: every sample over the process's whole life, open included.
    - ``cpu_ms_per_sample``: CPU of the process tree over its whole life per sample; peak RSS of the tree.
    - ``rx_bytes_per_sample``: bytes received by the client namespace per sample.

    Why the whole epoch, not a window inside it: a window that ends before the epoch does lets a reader
    that stops issuing at the window's end (told the order only up to there) drain its tail for free,
    while one that reads ahead pays for reads past the window; a window that starts after a warm-up
    credits whatever a reader banked during the warm-up. Measured both ways on this testbed: ~±30% swings
    between readers from where the window fell. Read to the end of the epoch, nothing is left over."""
    from asyncload.measure import PeakRSS

    n = spec["rows"]
    order = (
        list(range(n))
        if spec["order"] == "sequential"
        else [int(i) for i in np.random.default_rng(spec.get("seed", 0)).permutation(n)]
    )
    # every 0.1 s, not PeakRSS's default 20 ms: walking /proc for a process with Deep Lake's ~70 threads
    # 50 times a second took ~5% of a core, charged to every reader on a CPU-bound machine
    rss = PeakRSS(every_s=0.1)
    net0, thr0, c0 = net_counters(), thread_cpu_s(), tree_cpu_s(os.getpid())
    t_start = time.perf_counter()
    it = batches(spec, order, n)
    seen = s_first = 0
    t_first = wall_first = None
    try:
        for b in it:
            seen += _count(b)
            now = time.perf_counter()
            if t_first is None:
                t_first, s_first, wall_first = now, seen, time.time()
            if seen >= n or now - t_first >= spec["epoch_s"]:
                break
    finally:
        t1, c1, wall1 = time.perf_counter(), tree_cpu_s(os.getpid()), time.time()
        net1, thr1 = net_counters(), thread_cpu_s()
        stats = _LIVE["asyncload"].stats() if "asyncload" in _LIVE else {}
        close = getattr(it, "close", None)
        if close is not None:
            close()
    peak = rss.stop()
    import deeplake

    if t_first is None or seen <= s_first:
        return {"error": f"only {seen} samples read", "samples": seen}
    net = {k: v - net0[k] for k, v in net1.items()}
    return {
        "samples_per_s": (seen - s_first) / (t1 - t_first),
        "run_samples_per_s": seen / (t1 - t_start),
        "cpu_ms_per_sample": 1e3 * (c1 - c0) / seen,
        "peak_rss_mb": peak,
        "samples": seen,
        "first_batch_samples": s_first,
        "epoch_complete": seen >= n,
        "first_batch_s": t_first - t_start,
        "seconds": t1 - t_start,
        "rx_bytes_per_sample": net["rx_bytes"] / seen,
        "thread_cpu_ms_per_sample": {k: round(1e3 * (v - thr0.get(k, 0.0)) / seen, 3) for k, v in thr1.items()},
        "span_unix": [wall_first, wall1],
        "storage_threads": deeplake.storage.concurrency(),
        **net,
        **{f"asyncload_{k}": stats[k] for k in _STATS if k in stats},
    }
