"""Measuring a loader the same way everywhere: samples/s, CPU seconds per sample, peak RSS.

The demo, the ``load`` command and the benchmarks all report through ``measure`` so their figures are
comparable, and the plain sequential ``ds[i][col]`` loop lives here as the baseline every run measures
alongside the loader.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Measurement:
    """One timed pass: what was read and what it cost."""

    name: str
    samples: int
    seconds: float
    cpu_seconds: float
    first_batch_s: float | None
    peak_rss_mb: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def cpu_per_sample_ms(self) -> float:
        return 1e3 * self.cpu_seconds / self.samples if self.samples else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "samples_per_s": self.samples_per_s, "cpu_per_sample_ms": self.cpu_per_sample_ms}


def _count(batch: Any) -> int:
    if isinstance(batch, dict):
        first = next(iter(batch.values()))
        return len(first)
    if isinstance(batch, (list, tuple)):
        return len(batch[0]) if batch and hasattr(batch[0], "__len__") else len(batch)
    return len(batch)


def measure(name: str, batches: Iterable[Any], count: Callable[[Any], int] = _count) -> Measurement:
    """Iterate ``batches`` to the end, counting samples; CPU time covers every thread of this process."""
    t0, c0 = time.perf_counter(), time.process_time()
    first: float | None = None
    n = 0
    for b in batches:
        if first is None:
            first = time.perf_counter() - t0
        n += count(b)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    return Measurement(name, n, seconds, cpu, first, peak)


def sequential(url: str, columns: Sequence[str], limit: int | None = None, creds: dict[str, str] | None = None) -> Iterable[int]:
    """The baseline: ``ds[i][col]`` for each row and column, one after another, copied like a batch is."""
    import deeplake
    import numpy as np

    ds = deeplake.open_read_only(url, creds=creds) if creds else deeplake.open_read_only(url)
    n = len(ds) if limit is None else min(limit, len(ds))
    for i in range(n):
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
