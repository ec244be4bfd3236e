"""Assembly: the parts of one batch, read in groups, become the batch the consumer gets.

Runs on the loop's CPU pool, never on the loop thread: the decode stage for image and mask columns
(``decode``: stored bytes decoded and augmented straight into the batch tensors), collation of the other
columns into new writable tensors (``collate``), then a user's per-sample ``transform`` (Python, holding
the GIL) and ``collate_fn``, which see the decoded, augmented samples. Samples that fail to decode or
that a transform rejects are skipped, counted and reported with ``on_error="skip"``; otherwise the error
goes to the consumer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..image.decode import DecodeStage
from ..image.decode import run as decode_run
from ..image.normalize import image_columns
from .collate import CollateError, collate_column, collate_columns, default_collate, ragged_policy, rows
from .plan import Plan
from .protocol import EMPTY


@dataclass
class Assembled:
    """One batch, and what it cost: thread CPU seconds decoding (and augmenting) and the rest."""

    count: int
    batch: Any
    skipped: list[tuple[int, str]] = field(default_factory=list)
    decode_s: float = 0.0
    collate_s: float = 0.0
    started: float = 0.0  # ``perf_counter`` when assembly began (``stats.Timeline``)
    #: wall seconds decoding, augmenting, transforming, and the rest (collating)
    wall: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)


def assemble(plan: Plan, ordered: list[tuple[list[int], Any]]) -> Assembled:
    """``ordered``: ``(indices, columns read)`` parts in position order. Timed by the wall clock too, by
    stage (``Assembled.wall``): what the batch's consumer may have waited on (``stats.Stats.taken``)."""
    started = time.perf_counter()
    walls = [0.0, 0.0, 0.0]  # decode (augmentation included), augmentation, transform
    done = _assemble(plan, ordered, walls)
    total = time.perf_counter() - started
    dec, aug, tr = walls
    done.started = started
    done.wall = (max(0.0, dec - aug), aug, tr, max(0.0, total - dec - tr))
    return done


def _assemble(plan: Plan, ordered: list[tuple[list[int], Any]], walls: list[float]) -> Assembled:
    t0 = time.thread_time()
    indices = plan.source.row_ids([i for idx, _ in ordered for i in idx])
    parts = [p for _, p in ordered]
    cols = plan.source.columns
    if not indices:
        return Assembled(0, EMPTY)
    skipped: list[tuple[int, str]] = []
    decode_s = 0.0
    if plan.stage is not None:
        values = {c: [v for p in parts for v in p[c]] for c in cols}  # each column, sample by sample
    if plan.stage is not None and plan.stage.ship:  # a fan-out worker: the training process decodes
        from ..image.gpu import pack

        keep = list(range(len(indices)))
        batch = _batch(plan, cols, pack(plan.stage, cols, values, indices), values, keep, indices)
        return Assembled(len(indices), batch, [], 0.0, time.thread_time() - t0)
    if plan.stage is not None:
        w0 = time.perf_counter()
        tensors, keep, skipped, decode_s = _decoded(plan, plan.stage, cols, values, indices, walls)
        walls[0] += time.perf_counter() - w0
        indices = [indices[k] for k in keep]
        if not indices:
            return Assembled(0, EMPTY, skipped, decode_s, time.thread_time() - t0 - decode_s)
        if plan.transform is None and plan.collate_fn is None:
            batch = _batch(plan, cols, tensors, values, keep, indices)
            if plan.stage.ready is not None:  # model-ready image columns: one table lookup per batch
                t1 = time.thread_time()
                batch = plan.stage.ready.batch(batch, image_columns(plan.stage.columns))
                decode_s += time.thread_time() - t1
            return Assembled(len(indices), batch, skipped, decode_s, time.thread_time() - t0 - decode_s)
        samples: list[Any] = _samples(cols, tensors, values, keep, indices)
    elif plan.transform is None and plan.collate_fn is None:
        batch = collate_columns(cols, parts, indices, plan.with_index, plan.ragged)
        return Assembled(len(indices), batch, [], 0.0, time.thread_time() - t0)
    else:
        samples = rows(cols, parts, indices)
    if plan.transform is not None:
        w0 = time.perf_counter()
        out = []
        for s in samples:
            try:
                t = plan.transform(s)
            except Exception as exc:
                if plan.on_error == "raise":
                    raise
                skipped.append((s["index"], f"{type(exc).__name__} in transform: {exc}"))
                continue
            if plan.with_index and isinstance(t, dict) and "index" not in t:
                t["index"] = s["index"]
            out.append(t)
        samples = out
        walls[2] += time.perf_counter() - w0
    elif not plan.with_index:
        for s in samples:
            del s["index"]
    done = time.thread_time() - t0 - decode_s
    if not samples:
        return Assembled(0, EMPTY, skipped, decode_s, done)
    result = plan.collate_fn(samples) if plan.collate_fn is not None else default_collate(samples, plan.ragged)
    return Assembled(len(samples), result, skipped, decode_s, time.thread_time() - t0 - decode_s)


def _decoded(
    plan: Plan,
    stage: DecodeStage,
    cols: tuple[str, ...],
    values: dict[str, list[Any]],
    indices: list[int],
    walls: list[float],
) -> tuple[dict[str, Any], list[int], list[tuple[int, str]], float]:
    """The decode stage's tensors (image and mask columns), the positions of the samples that decoded,
    the skipped ones, and the thread CPU seconds it took. ``walls[1]``: wall seconds of the augmentation
    added (CPU decoder)."""
    t0 = time.thread_time()
    if stage.device is not None:
        from ..image.gpu import run as gpu_run

        tensors, keep, skipped = gpu_run(stage, cols, values, indices)
    else:
        tensors, keep, skipped = decode_run(stage, cols, values, indices, walls)
    return tensors, keep, skipped, time.thread_time() - t0


def _batch(
    plan: Plan,
    cols: tuple[str, ...],
    tensors: dict[str, Any],
    values: dict[str, list[Any]],
    keep: list[int],
    kept: list[int],
) -> dict[str, Any]:
    """The default batch: the decoded columns, the others collated as ``collate`` does, and the index."""
    batch: dict[str, Any] = {k: v for k, v in tensors.items() if k not in cols}  # (``gpu.pack``'s keys)
    for c in cols:
        got = tensors.get(c)
        if isinstance(got, (torch.Tensor, dict)):  # a batch tensor, or a column packed for the parent
            batch[c] = got
        elif isinstance(got, list) and got and isinstance(got[0], torch.Tensor):  # on a GPU, unequal sizes
            if ragged_policy(plan.ragged, c) is None:
                raise CollateError(
                    f"column {c!r}: samples of different shapes need ragged={{{c!r}: 'list'}} or a Resize"
                )
            batch[c] = got
        else:  # a column the stage does not own, or decoded samples of unequal sizes
            got = tensors[c] if c in tensors else [values[c][k] for k in keep]
            batch.update(collate_column(c, [got], len(kept), kept, ragged_policy(plan.ragged, c)))
    if plan.with_index:
        batch["index"] = torch.tensor(kept, dtype=torch.int64)
    return batch


def _samples(
    cols: tuple[str, ...], tensors: dict[str, Any], values: dict[str, list[Any]], keep: list[int], kept: list[int]
) -> list[dict[str, Any]]:
    """Per-sample dicts for a user's transform: decoded columns as writable NumPy views of their rows in
    the batch tensor, the other columns as read, and ``"index"``."""
    samples: list[dict[str, Any]] = []
    for j, (k, i) in enumerate(zip(keep, kept, strict=True)):
        s: dict[str, Any] = {}
        for c in cols:
            if c in tensors:
                item = tensors[c][j]
                s[c] = item.numpy() if isinstance(item, torch.Tensor) and item.device.type == "cpu" else item
            else:
                s[c] = values[c][k]
        s["index"] = i
        samples.append(s)
    return samples


__all__ = ["Assembled", "assemble"]
