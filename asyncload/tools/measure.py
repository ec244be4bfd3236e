"""Measuring a loader the same way everywhere: samples/s, CPU seconds per sample, peak RSS.

The demo, the ``load`` command and the benchmarks all report through ``measure`` so their figures are
comparable, and the plain sequential ``ds[i][col]`` loop lives here as the baseline every run measures
alongside the loader.

- Throughput is taken from the first batch to the last (the samples after the first batch over that
  time): a DataLoader's worker start-up is reported as time to first batch instead of diluting
  samples/s. The whole span, not a later window: in-order delivery is bursty (a late batch holds back
  the ones behind it), so a window that starts mid-run can catch one burst and report nonsense.
- CPU time counts this process and its children (DataLoader workers, fan-out processes) once they have
  been reaped, which is why the iterator is closed before the clock stops. ``live_tree`` counts the live
  ones too (``/proc``): a loader kept open between epochs, whose reader process is still there, and a
  forkserver's children, which the server reaps, not this process.
- Peak RSS is sampled every 20 ms over this process and its children (``/proc``), during the run only;
  ``rss_growth_mb`` is that peak minus the RSS at the start, which is what the loader itself added when
  several runs are measured one after another in one long-lived process.
"""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..runtime.loop import start_thread

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass
class Measurement:
    """One timed pass: what was read and what it cost."""

    name: str
    samples: int
    seconds: float
    cpu_seconds: float
    first_batch_s: float | None
    peak_rss_mb: float
    steady_samples: int = 0
    steady_seconds: float = 0.0
    rss_growth_mb: float = 0.0  # peak during the run minus the RSS when it started: what this loader added
    #: of ``cpu_seconds``: this process's own (every thread), the thread that iterated (the consumer) and
    #: the memory sampler's thread (``PeakRSS``: the measurement's, not the reader's); the rest is the
    #: child processes' (a reader process, DataLoader or fan-out workers)
    own_cpu_seconds: float = 0.0
    consumer_cpu_seconds: float = 0.0
    sampler_cpu_seconds: float = 0.0

    @property
    def samples_per_s(self) -> float:
        if self.steady_seconds > 0 and self.steady_samples > 0:
            return self.steady_samples / self.steady_seconds
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_per_sample_ms(self) -> float:
        return 1e3 * self.cpu_seconds / self.samples if self.samples else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_s": self.samples_per_s, "cpu_per_sample_ms": self.cpu_per_sample_ms}


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return kids


def tree_pids(pid: int | None = None) -> list[int]:
    """A process (this one by default) and its live descendants."""
    pid = os.getpid() if pid is None else pid
    return [pid, *descendants(pid)]


def tree_rss_bytes(pid: int | None = None) -> int:
    """Resident memory of a process and all its descendants (Linux ``/proc``; 0 elsewhere)."""
    return sum(_rss_bytes(p) for p in tree_pids(pid))


class PeakRSS:
    """Samples the resident memory of this process and its descendants on a thread while active;
    ``peak_mb`` after ``stop``.

    The descendants are looked for every ``find_every`` samples, the memory of those found read at every
    sample: finding them reads a ``children`` file per thread of each process (a process of Deep Lake has
    130 threads, a loader with a reader process twice that), which at 10 walks a second cost a loader's run
    0.05-0.17 ms of CPU a sample (``benchmarks/results/cpu/``), several times what reading the memory costs."""

    def __init__(self, every_s: float = 0.02, find_every: int = 10) -> None:
        self.every_s = every_s
        self.find_every = max(1, find_every)
        self._pids = tree_pids()
        self.peak = self.start = self._rss()
        self.cpu_s = 0.0  # its own thread's CPU, once stopped
        self._stop = threading.Event()
        self._thread = start_thread(self._run, name="peak-rss")

    def _rss(self) -> int:
        return sum(_rss_bytes(p) for p in self._pids)

    def _run(self) -> None:
        k = 0
        while not self._stop.wait(self.every_s):
            k += 1
            if k % self.find_every == 0:
                self._pids = tree_pids()
            self.peak = max(self.peak, self._rss())
        self.cpu_s = time.thread_time()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, tree_rss_bytes())
        return self.peak / 2**20


def count_samples(batch: Any) -> int:
    """Samples in a batch: a dict of tensors, a list/tuple of them, or a sized object."""
    if isinstance(batch, dict):
        return len(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return len(batch[0]) if batch and hasattr(batch[0], "__len__") else len(batch)
    return len(batch)


def _cpu(live_tree: frozenset[int] | None = None) -> float:
    """CPU seconds of this process (every thread) and of its joined children. Not ``os.times()``: it counts
    in clock ticks (10 ms here), and a short run of a few samples read as 0 CPU. With ``live_tree``, the
    live descendants' too (``live_tree_cpu``)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = live_tree_cpu(live_tree) if live_tree is not None else 0.0
    return time.process_time() + kids.ru_utime + kids.ru_stime + live


def _stat_cpu(pid: int) -> float:
    """CPU seconds of a live process and of the children it has reaped (``/proc/<pid>/stat``), 0 if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in rest[11:15]) / _TICK  # utime, stime, cutime, cstime
    except (OSError, IndexError, ValueError):
        return 0.0


def live_tree_cpu(leave_out: frozenset[int] = frozenset()) -> float:
    """CPU seconds of this process's live descendants, each with the children it reaped (a forkserver's
    workers land there), from ``/proc``; the processes in ``leave_out`` and theirs are not counted (what
    ran before a measurement began: a test's server, say). A child that is reaped between two readings
    moves from here into ``RUSAGE_CHILDREN``, so ``_cpu`` stays continuous."""
    total, todo = 0.0, [p for p in _children(os.getpid()) if p not in leave_out]
    while todo:
        p = todo.pop()
        total += _stat_cpu(p)
        todo += [c for c in _children(p) if c not in leave_out]
    return total


def descendants(pid: int | None = None) -> frozenset[int]:
    """The pids of a process's (this one's by default) live descendants now (``/proc``: each of their
    threads' ``children``)."""
    out: set[int] = set()
    todo = _children(os.getpid() if pid is None else pid)
    while todo:
        p = todo.pop()
        out.add(p)
        todo += _children(p)
    return frozenset(out)


def measure(
    name: str,
    batches: Iterable[Any],
    count: Callable[[Any], int] = count_samples,
    *,
    max_samples: int | None = None,
    max_seconds: float | None = None,
    on_batch: Callable[[Any], None] | None = None,
    live_tree: frozenset[int] | None = None,
) -> Measurement:
    """Iterate ``batches`` to the end, or until ``max_samples``/``max_seconds``, then close it.
    ``live_tree``: count the CPU of live descendants too, leaving out these pids (see ``live_tree_cpu``)."""
    rss = PeakRSS()
    t0, c0 = time.perf_counter(), _cpu(live_tree)
    own0, mine0 = time.process_time(), time.thread_time()
    first: float | None = None
    n = n_first = batches_seen = 0
    last = 0.0
    it = iter(batches)
    try:
        for b in it:
            n += count(b)
            batches_seen += 1
            last = now = time.perf_counter() - t0
            if first is None:
                first, n_first = now, n
            if on_batch is not None:
                on_batch(b)
            if max_samples is not None and n >= max_samples:
                break
            if max_seconds is not None and first is not None and now - first >= max_seconds:
                break  # counted from the first batch: start-up is not part of the budget
    finally:
        end, consumer = time.perf_counter(), time.thread_time() - mine0
        close = getattr(it, "close", None)
        if close is not None:
            close()
        del it  # DataLoader workers are joined here, so their CPU time is counted
    cpu, own = _cpu(live_tree) - c0, time.process_time() - own0
    steady_n, steady_s = 0, 0.0
    if first is not None and batches_seen >= 3 and last > first:  # too few batches: no steady state
        steady_n, steady_s = n - n_first, last - first
    peak_mb = rss.stop()
    return Measurement(
        name, n, end - t0, cpu, first, peak_mb, steady_n, steady_s, peak_mb - rss.start / 2**20,
        own_cpu_seconds=own, consumer_cpu_seconds=consumer, sampler_cpu_seconds=rss.cpu_s,
    )  # fmt: skip


def cpu_stages(
    total_s: float, children_s: float, decode_s: float, collate_s: float, consumer_s: float, harness_s: float = 0.0
) -> dict[str, float]:
    """asyncload's CPU by stage, in seconds: decode (decode, crop, resize, flip) and collate (collation and a
    ``transform=`` callable) as its ``stats()`` counts them, the consumer (the thread that iterated), child
    processes (a reader process: its start, Deep Lake's reads and the answers; fan-out workers), and fetch as
    the rest of the training process (the event loop, the node store's writes, the thread receiving a
    reader's answers, or Deep Lake's storage threads without a reader process); ``harness_s`` (a measurement's
    own sampling thread) is left out of every stage."""
    return {
        "reader processes": children_s,
        "fetch": max(total_s - children_s - decode_s - collate_s - consumer_s - harness_s, 0.0),
        "decode": decode_s,
        "collate": collate_s,
        "consumer": consumer_s,
    }


def sequential(source: Any, columns: Sequence[str], limit: int | None = None) -> Iterable[int]:
    """The baseline: ``ds[i][col]`` for each row and column, one after another, copied like a batch is.

    ``source``: a ``DeepLakeSource``, opened: the baseline reads what the loader reads (its credentials,
    its version, the rows of its query, in the query's order), or the comparison would not be fair."""
    import numpy as np

    ds = source.dataset()  # at the source's version, with its credentials
    n = len(source) if limit is None else min(limit, len(source))
    for i in source.row_ids(list(range(n))):
        row = ds[i]
        for c in columns:
            np.array(row[c])
        yield 1


def table(rows: Sequence[Measurement], baseline: Measurement | None = None) -> str:
    """A markdown table of measurements, with throughput as a ratio to ``baseline``."""
    head = "| loader | samples | samples/s | × baseline | CPU ms/sample | first batch s | peak RSS MB |\n|---|---|---|---|---|---|---|"
    lines = [head]
    for m in rows:
        ratio = f"{m.samples_per_s / baseline.samples_per_s:.2f}" if baseline and baseline.samples_per_s else "-"
        fb = f"{m.first_batch_s:.3f}" if m.first_batch_s is not None else "-"
        lines.append(
            f"| {m.name} | {m.samples} | {m.samples_per_s:,.0f} | {ratio} | {m.cpu_per_sample_ms:.2f} | {fb} | {m.peak_rss_mb:,.0f} |"
        )
    return "\n".join(lines)
