"""Counters that make every sample's journey countable: issued, in flight, ready, yielded.

Written by the loop thread, read from any thread. Each field is a plain number updated by one writer, so
a snapshot needs no lock; percentiles come from a bounded window of recent read latencies.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Stats:
    """Live counters of one epoch's pipeline."""

    started: float = field(default_factory=time.perf_counter)
    requests: int = 0
    samples_read: int = 0
    in_flight: int = 0
    batches_ready: int = 0
    batches_yielded: int = 0
    samples_yielded: int = 0
    wait_s: float = 0.0
    first_batch_s: float | None = None
    finished: float | None = None
    bytes_read: int = 0
    concurrency: int = 0  # samples allowed in flight now (moves with concurrency="auto")
    waiting_since: float | None = None  # set while the consumer is blocked waiting for a batch
    hedges: int = 0  # second requests sent for stragglers
    hedges_won: int = 0  # ... that answered first
    skipped: int = 0
    stalls: int = 0  # outages of the store ridden out (silent or unreachable, then answering again)
    stall_wait_s: float = 0.0  # seconds spent waiting on them
    stall_since: float | None = None  # while a stall lasts: when the store last answered (perf_counter)
    stall_timeout: float | None = None  # the deadline the epoch gives a silent store
    worker_restarts: int = 0  # reader processes that died and were replaced (fan-out, or the default isolation)
    memory_budget: int = 0  # the byte budget of batches alive (read, decoded, ready)
    bytes_held: int = 0  # bytes read and decoded that the pipeline holds now (ready batches included)
    bytes_held_peak: int = 0
    cpu_loop_s: float = 0.0  # thread CPU seconds of the loop thread (issuing and awaiting reads)
    cpu_decode_s: float = 0.0  # thread CPU seconds in the decode stage (decode, crop, resize, flip)
    cpu_collate_s: float = 0.0  # ... in the rest of assembly (collation, a user's transform)
    # The read stage (``blocks.BlockReads``) and the node block store (``sources.nodestore``):
    remote_bytes: int = 0  # bytes the read stage fetched from the source (the remote store, or a local path)
    node_hits: int = 0  # rows served from the node store's disk
    node_misses: int = 0  # rows the node store did not have, fetched from the remote (0 without the store)
    node_not_kept: int = 0  # rows fetched that the node store did not keep (over its limit, or failed)
    node_corrupt: int = 0  # parts on disk that failed their checksum (deleted, rows fetched again)
    node_read_bytes: int = 0  # bytes read from the node store's disk
    skipped_samples: list[tuple[int, str]] = field(default_factory=list)  # the first MAX_SKIP_RECORDS
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=2048))

    MAX_SKIP_RECORDS = 1000

    def record_skipped(self, items: list[tuple[int, str]]) -> None:
        self.skipped += len(items)
        room = self.MAX_SKIP_RECORDS - len(self.skipped_samples)
        if room > 0:
            self.skipped_samples.extend(items[:room])

    def snapshot(self) -> dict[str, Any]:
        """A plain dict of the current figures (safe to log or serialise)."""
        elapsed = max((self.finished or time.perf_counter()) - self.started, 1e-9)
        lat = np.fromiter(self.latencies, float) if self.latencies else None
        pct = {f"read_p{q}_ms": (float(np.percentile(lat, q)) * 1e3 if lat is not None else None) for q in (50, 90, 99)}
        return {
            "elapsed_s": elapsed,
            "samples_per_s": self.samples_yielded / elapsed,
            "bytes_per_s": self.bytes_read / elapsed,
            "concurrency": self.concurrency,
            "requests": self.requests,
            "samples_read": self.samples_read,
            "in_flight": self.in_flight,
            "ready_batches": self.batches_ready - self.batches_yielded,
            "batches_yielded": self.batches_yielded,
            "samples_yielded": self.samples_yielded,
            "consumer_wait_s": self.wait_s,
            "skipped": self.skipped,
            "worker_restarts": self.worker_restarts,
            "stalls": self.stalls,
            "stall_wait_s": self.stall_wait_s,
            "stalled_s": (time.perf_counter() - self.stall_since) if self.stall_since is not None else None,
            "stall_timeout": self.stall_timeout,
            "hedges": self.hedges,
            "hedges_won": self.hedges_won,
            "time_to_first_batch_s": self.first_batch_s,
            "memory_budget": self.memory_budget,
            "bytes_held": self.bytes_held,
            "bytes_held_peak": self.bytes_held_peak,
            "cpu_loop_s": self.cpu_loop_s,
            "cpu_decode_s": self.cpu_decode_s,
            "cpu_collate_s": self.cpu_collate_s,
            "remote_bytes": self.remote_bytes,
            "node_hits": self.node_hits,
            "node_misses": self.node_misses,
            "node_hit_rate": self.node_hits / (self.node_hits + self.node_misses)
            if self.node_hits + self.node_misses
            else None,
            "node_not_kept": self.node_not_kept,
            "node_corrupt": self.node_corrupt,
            "node_read_bytes": self.node_read_bytes,
            **pct,
        }

    def consumer_wait(self, now: float) -> float:
        """Seconds the consumer has waited for batches so far, the wait in progress at ``now`` included."""
        return self.wait_s + (now - self.waiting_since if self.waiting_since else 0.0)

    def line(self) -> str:
        """One log line of the figures that matter while a run is going."""
        s = self.snapshot()
        p = " ".join(f"p{q}={s[f'read_p{q}_ms']:.0f}ms" for q in (50, 90, 99) if s[f"read_p{q}_ms"] is not None)
        return (
            f"{s['samples_per_s']:,.0f} samples/s {s['bytes_per_s'] / 2**20:,.1f} MiB/s, {s['in_flight']} in flight "
            f"(limit {s['concurrency']}), {s['ready_batches']} ready, read {p}, consumer waited "
            f"{s['consumer_wait_s']:.1f}s, hedges {s['hedges']}, skipped {s['skipped']}"
            + (f", no answer for {s['stalled_s']:.0f}s (deadline {s['stall_timeout']:.0f}s)" if s["stalled_s"] else "")
            + (f", stalls {s['stalls']} ({s['stall_wait_s']:.0f}s)" if s["stalls"] else "")
        )
