"""Counters that make every sample's journey countable: issued, in flight, ready, yielded.

Written by the loop thread, read from any thread. Each field is a plain number updated by one writer, so
a snapshot needs no lock; percentiles come from a bounded window of recent read latencies.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

#: The pipeline's stages as ``waiting_on`` names them, in pipeline order; each has a ``wait_on_<stage>_s``.
STAGES = ("store", "decode", "augment", "transform", "collate")
CPU_STAGES = STAGES[1:]
#: ``waiting_on`` is "training" while the consumer waits less than this fraction of its time.
TRAINING_BOUND = 0.10
#: Without a wait to attribute (fan-out, the first batch only): the CPU pool busier than this is the bottleneck.
CPU_SATURATED = 0.75


class Timeline(NamedTuple):
    """One batch's way through the pipeline (``perf_counter``): its last read answered (``read``), its
    assembly began on the CPU pool (``start``), it was put on the ready queue (``put``), and the wall
    seconds of each CPU stage (``cpu``: decode, augment, transform, collate)."""

    read: float
    start: float
    put: float
    cpu: tuple[float, float, float, float]


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
    first_read_s: float | None = None  # from the epoch's start to the first read's answer
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
    # The read stage (``blocks.BlockReads``) and the node block store (``nodestore``):
    # bytes received from the source: the wire bytes where it counts them (``wire_counter``), else the
    # stored bytes of the rows the read stage fetched (Deep Lake, whose chunk reads are its own)
    remote_bytes: int = 0
    node_hits: int = 0  # rows served from the node store's disk
    node_misses: int = 0  # rows the node store did not have, fetched from the remote (0 without the store)
    node_not_kept: int = 0  # rows fetched that the node store did not keep (over its limit, or failed)
    node_corrupt: int = 0  # parts on disk that failed their checksum (deleted, rows fetched again)
    node_read_bytes: int = 0  # bytes read from the node store's disk
    store_write_s: float = 0.0  # writing fetched rows to the node store (off the loop, summed over writes)
    # Where the time goes (``waiting_on``): wall seconds per stage, summed over the batches (stages overlap)
    open_s: float = 0.0  # opening the source (``AsyncLoader``'s constructor)
    read_s: float = 0.0  # store requests, answer to answer (node store hits included), summed over requests
    decode_s: float = 0.0  # the decode stage without the augmentation (CPU pool)
    augment_s: float = 0.0  # the built-in augmentation (``augment=``: crop, resize, flip) (CPU pool)
    transform_s: float = 0.0  # a user's ``transform`` (CPU pool)
    collate_s: float = 0.0  # collation, ``collate_fn``, the model-ready conversion (CPU pool)
    cpu_workers: int = 0  # threads of the CPU pool (summed over the processes that read)
    queue_s: float = 0.0  # batches ready, waiting in the ready queue for the consumer
    step_s: float = 0.0  # the consumer between its ``next()`` calls: the training step
    steady_wait_s: float = 0.0  # ``wait_s`` without the first batch's (the start-up)
    # the consumer's steady wait, by what the batch it waited for was doing (``Timeline``)
    wait_on_store_s: float = 0.0
    wait_on_decode_s: float = 0.0
    wait_on_augment_s: float = 0.0
    wait_on_transform_s: float = 0.0
    wait_on_collate_s: float = 0.0
    wait_on_other_s: float = 0.0  # the hand-over, the reorder buffer, a failed batch
    returned_at: float | None = None  # when ``next()`` last returned a batch (the step began)
    timeline: deque[Timeline] = field(default_factory=deque)  # of batches put on the ready queue, not yet taken
    skipped_samples: list[tuple[int, str]] = field(default_factory=list)  # the first MAX_SKIP_RECORDS
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=2048))

    MAX_SKIP_RECORDS = 1000

    def record_skipped(self, items: list[tuple[int, str]]) -> None:
        self.skipped += len(items)
        room = self.MAX_SKIP_RECORDS - len(self.skipped_samples)
        if room > 0:
            self.skipped_samples.extend(items[:room])

    def taken(self, t0: float, t1: float) -> None:
        """The consumer took the batch at the head of ``timeline`` at ``t1``, having waited for it since
        ``t0``: the time it sat ready counts in ``queue_s``, and a steady wait (any batch but the first)
        is split by what that batch was doing meanwhile: being read (store), waiting for or running on the
        CPU pool (its stages, in proportion to their seconds), or anything after (other). A few µs."""
        if not self.timeline:  # a fan-out parent: its workers attribute their own waits
            return
        tl = self.timeline.popleft()
        self.queue_s += max(0.0, t1 - tl.put)
        if not self.batches_yielded:
            return
        waited = t1 - t0
        if waited <= 0.0:
            return
        store = min(max(tl.read - t0, 0.0), waited)
        busy = sum(tl.cpu)
        cpu = max(0.0, min(t1, tl.start + busy) - max(t0, tl.read)) if busy > 0.0 else 0.0
        cpu = min(cpu, waited - store)
        self.wait_on_store_s += store
        self.wait_on_other_s += waited - store - cpu
        if cpu:
            dec, aug, tr, col = (cpu * x / busy for x in tl.cpu)
            self.wait_on_decode_s += dec
            self.wait_on_augment_s += aug
            self.wait_on_transform_s += tr
            self.wait_on_collate_s += col

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
            "time_to_first_read_s": self.first_read_s,
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
            "store_write_s": self.store_write_s,
            **pct,
            **self.where_time_goes(elapsed),
        }

    def where_time_goes(self, elapsed: float) -> dict[str, Any]:
        """The stage figures of ``snapshot`` and their verdict (``verdict``; units in the key names)."""
        now = time.perf_counter()
        step = self.step_s
        if self.waiting_since is None and self.returned_at is not None and self.finished is None:
            step += now - self.returned_at  # the step in progress
        wait = self.steady_wait_s + (now - self.waiting_since if self.waiting_since and self.batches_yielded else 0.0)
        busy = self.decode_s + self.augment_s + self.transform_s + self.collate_s
        figures: dict[str, Any] = {
            "open_s": self.open_s, "read_s": self.read_s, "decode_s": self.decode_s, "augment_s": self.augment_s,
            "transform_s": self.transform_s, "collate_s": self.collate_s, "queue_s": self.queue_s,
            "step_s": step, "steady_wait_s": wait,
            "consumer_wait_frac": wait / (wait + step) if wait + step > 0 else None,
            "cpu_workers": self.cpu_workers,
            "cpu_busy_frac": busy / (self.cpu_workers * elapsed) if self.cpu_workers else None,
            **{f"wait_on_{k}_s": getattr(self, f"wait_on_{k}_s") for k in (*STAGES, "other")},
        }  # fmt: skip
        figures["waiting_on"], figures["waiting_on_why"] = verdict(figures | {"batches_yielded": self.batches_yielded})
        return figures

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


def wire_counter(source: Any) -> Callable[[], int] | None:
    """The source's running count of bytes received from the store in this process (``received_bytes``:
    an object store counts its GETs' bodies), or None where it keeps none. Where there is one,
    ``remote_bytes`` is its growth over the epoch: the bytes as they crossed the wire, whatever the read
    stage or the decoding made of them."""
    counter = getattr(source, "received_bytes", None)
    return counter if callable(counter) else None


#: ``Stats`` fields a process shares with the one that sums them (``row``/``summed``: DataLoader workers).
SHARED = (
    "requests", "samples_read", "batches_yielded", "samples_yielded", "bytes_read", "wait_s", "skipped", "stalls",
    "stall_wait_s", "hedges", "hedges_won", "worker_restarts", "remote_bytes", "node_hits", "node_misses",
    "node_not_kept", "node_corrupt", "node_read_bytes", "store_write_s", "cpu_decode_s", "cpu_collate_s", "open_s",
    "read_s", "decode_s", "augment_s", "transform_s", "collate_s", "cpu_workers", "queue_s", "step_s", "steady_wait_s",
    *(f"wait_on_{k}_s" for k in (*STAGES, "other")),
)  # fmt: skip
#: A row: the ``SHARED`` fields, then the process's elapsed seconds, its epoch, and 1.0 once written.
ROW = len(SHARED) + 3


def row(st: Stats, epoch: int) -> list[float]:
    """``st`` as one row of numbers (``SHARED``, elapsed, epoch, written), for a shared-memory table."""
    elapsed = (st.finished or time.perf_counter()) - st.started
    return [float(getattr(st, f)) for f in SHARED] + [elapsed, float(epoch), 1.0]


def summed(rows: Any) -> Stats | None:
    """The ``Stats`` of the written rows of the latest epoch among ``rows`` (a 2-d array of ``row``s), summed,
    its elapsed the longest of theirs; None when no row was written."""
    written = [r for r in rows if r[-1] == 1.0]
    if not written:
        return None
    epoch = max(r[-2] for r in written)
    mine = [r for r in written if r[-2] == epoch]
    st = Stats()
    for k, f in enumerate(SHARED):
        total = sum(float(r[k]) for r in mine)
        setattr(st, f, int(total) if isinstance(getattr(st, f), int) else total)
    now = time.perf_counter()
    st.started, st.finished = now - max(float(r[-3]) for r in mine), now
    return st


def verdict(s: Mapping[str, Any]) -> tuple[str, str]:
    """What the training loop is waiting on, and why in a sentence, from ``stats()``'s figures.

    The rule (steady state: the first batch's wait, the start-up, is left out):

    1. "training" when the consumer waited less than ``TRAINING_BOUND`` (10 %) of its time
       (``consumer_wait_frac``): the loader keeps ahead, the training step is the slower side.
    2. Else the stage whose ``wait_on_<stage>_s`` is largest: each wait of the consumer is charged to what
       the batch it waited for was doing meanwhile (being read: "store"; on the CPU pool: "decode",
       "augment", "transform", "collate", in proportion to their seconds). With ``copy_wait_frac`` (a
       ``DeviceFeed``): "copy" when the feed's thread waited less than 10 % on the loader.
    3. Without a wait to attribute (batches from ``processes=K`` workers that did not wait, a single batch):
       the CPU stage with the most seconds when the CPU pool was busy over ``CPU_SATURATED`` (75 %) of
       the time (``cpu_busy_frac``), else "store".

    "start" until the first batch arrives. Cheap: a few sums of numbers already in ``s``."""
    frac = s.get("consumer_wait_frac")
    if not s.get("batches_yielded"):
        return "start", "no batch yet: the store is being opened and the first batch read"
    if frac is None:
        frac = 1.0
    if frac < TRAINING_BOUND:
        return "training", (
            f"the training step is the slower side: the loop waited for data {frac:.0%} of its time "
            f"(under {TRAINING_BOUND:.0%})"
        )
    copy = s.get("copy_wait_frac")
    if copy is not None and copy < TRAINING_BOUND:
        return "copy", (
            f"the training loop waited for data {frac:.0%} of its time, on the copy to the device: the feed's "
            f"thread waited on the loader only {copy:.0%} of its time"
        )
    waits = {k: s.get(f"wait_on_{k}_s") or 0.0 for k in STAGES}
    total = sum(waits.values()) + (s.get("wait_on_other_s") or 0.0)
    stage = max(waits, key=lambda k: waits[k])
    if waits[stage] > 0.0:
        return stage, (
            f"the training loop waited for data {frac:.0%} of its time; {waits[stage] / total:.0%} of that wait was "
            f"on {_WHAT[stage]}"
        )
    busy = s.get("cpu_busy_frac")
    if busy is not None and busy >= CPU_SATURATED:
        stage = max(CPU_STAGES, key=lambda k: s.get(f"{k}_s") or 0.0)
        return stage, (
            f"the training loop waited for data {frac:.0%} of its time; the CPU pool was busy {busy:.0%} of the "
            f"time, most of it on {_WHAT[stage]}"
        )
    return "store", (
        f"the training loop waited for data {frac:.0%} of its time; the CPU pool was not saturated"
        + (f" ({busy:.0%} busy)" if busy is not None else "")
        + ", so on the reads"
    )


#: How ``verdict``'s sentence names each stage.
_WHAT = {
    "store": "the store's reads",
    "decode": "decoding",
    "augment": "the augmentation (augment=)",
    "transform": "the transform",
    "collate": "collation",
}


def summary(s: Mapping[str, Any]) -> str:
    """One line for a progress display: ``waiting on store (data wait 63%)`` (``asyncload load``)."""
    frac = s.get("consumer_wait_frac")
    wait = f" (data wait {frac:.0%})" if frac is not None else ""
    return f"waiting on {s.get('waiting_on', verdict(s)[0])}{wait}"
