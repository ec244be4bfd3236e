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

from . import decode
from ._protocol import EMPTY
from .collate import collate_column, collate_columns, default_collate, ragged_policy, rows
from .plan import Plan


@dataclass
class Assembled:
    """One batch, and what it cost: thread CPU seconds decoding (and augmenting) and the rest."""

    count: int
    batch: Any
    skipped: list[tuple[int, str]] = field(default_factory=list)
    decode_s: float = 0.0
    collate_s: float = 0.0


def assemble(plan: Plan, ordered: list[tuple[list[int], Any]]) -> Assembled:
    """``ordered``: ``(indices, columns read)`` parts in position order."""
    t0 = time.thread_time()
    indices = plan.source.row_ids([i for idx, _ in ordered for i in idx])
    parts = [p for _, p in ordered]
    cols = plan.source.columns
    if not indices:
        return Assembled(0, EMPTY)
    skipped: list[tuple[int, str]] = []
    decode_s = 0.0
    if plan.stage is not None:
        batch, indices, skipped, decode_s = _staged(plan, plan.stage, cols, parts, indices)
        if not indices:
            return Assembled(0, EMPTY, skipped, decode_s, time.thread_time() - t0 - decode_s)
        if plan.transform is None and plan.collate_fn is None:
            return Assembled(len(indices), batch, skipped, decode_s, time.thread_time() - t0 - decode_s)
        samples: list[Any] = _split(cols, batch, indices)
    elif plan.transform is None and plan.collate_fn is None:
        batch = collate_columns(cols, parts, indices, plan.with_index, plan.ragged)
        return Assembled(len(indices), batch, [], 0.0, time.thread_time() - t0)
    else:
        samples = rows(cols, parts, indices)
    if plan.transform is not None:
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
    elif not plan.with_index:
        for s in samples:
            del s["index"]
    done = time.thread_time() - t0 - decode_s
    if not samples:
        return Assembled(0, EMPTY, skipped, decode_s, done)
    result = plan.collate_fn(samples) if plan.collate_fn is not None else default_collate(samples, plan.ragged)
    return Assembled(len(samples), result, skipped, decode_s, time.thread_time() - t0 - decode_s)


def _staged(
    plan: Plan, stage: decode.Stage, cols: tuple[str, ...], parts: list[Any], indices: list[int]
) -> tuple[dict[str, Any], list[int], list[tuple[int, str]], float]:
    """The decode stage's columns and the plainly collated rest, for the samples that decoded."""
    values = {c: [v for p in parts for v in p[c]] for c in cols}
    t0 = time.thread_time()
    if stage.device is not None:
        from . import gpu

        tensors, keep, skipped = gpu.run(stage, cols, values, indices, lambda c: ragged_policy(plan.ragged, c))
    else:
        tensors, keep, skipped = decode.run(stage, cols, values, indices, lambda c: ragged_policy(plan.ragged, c))
    decode_s = time.thread_time() - t0
    kept = [indices[k] for k in keep]
    batch: dict[str, Any] = {}
    for c in cols:
        if c in tensors:
            batch[c] = tensors[c]
        elif c not in stage.columns and kept:
            batch.update(collate_column(c, [[values[c][k] for k in keep]], len(kept), kept, ragged_policy(plan.ragged, c)))
    if plan.with_index:
        batch["index"] = torch.tensor(kept, dtype=torch.int64)
    return batch, kept, skipped, decode_s


def _split(cols: tuple[str, ...], batch: dict[str, Any], indices: list[int]) -> list[dict[str, Any]]:
    """Per-sample dicts of a decoded batch, for a user's transform: each value a writable NumPy view of
    the sample's row (or its own tensor's array where the column is a list), plus ``"index"``."""
    samples: list[dict[str, Any]] = []
    for j, i in enumerate(indices):
        s: dict[str, Any] = {}
        for c in cols:
            v = batch.get(c)
            if v is None:
                continue
            item = v[j]
            s[c] = item.numpy() if isinstance(item, torch.Tensor) else item
        s["index"] = i
        samples.append(s)
    return samples


__all__ = ["Assembled", "assemble"]
