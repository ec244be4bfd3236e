"""Assembly: the parts of one batch, read in groups, become the batch the consumer gets.

Runs on the loop's CPU pool, never on the loop thread: per-sample ``transform`` (Python, holding the
GIL), then collation into new writable tensors (``collate``). Samples a transform rejects are skipped,
counted and reported with ``on_error="skip"``; otherwise the error goes to the consumer.
"""

from __future__ import annotations

from typing import Any

from ._protocol import EMPTY
from .collate import collate_columns, default_collate, rows
from .plan import Plan


def assemble(plan: Plan, ordered: list[tuple[list[int], Any]]) -> tuple[int, Any, list[tuple[int, str]]]:
    """``ordered``: ``(indices, columns read)`` parts in position order. Returns the sample count, the
    batch (``EMPTY`` if every sample was skipped) and the samples the transform skipped, with why."""
    indices = plan.source.row_ids([i for idx, _ in ordered for i in idx])
    parts = [p for _, p in ordered]
    cols = plan.source.columns
    if not indices:
        return 0, EMPTY, []
    if plan.transform is None and plan.collate_fn is None:
        return len(indices), collate_columns(cols, parts, indices, plan.with_index, plan.ragged), []
    samples: list[Any] = rows(cols, parts, indices)
    skipped: list[tuple[int, str]] = []
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
    if not samples:
        return 0, EMPTY, skipped
    if plan.collate_fn is not None:
        return len(samples), plan.collate_fn(samples), skipped
    return len(samples), default_collate(samples, plan.ragged), skipped


__all__ = ["assemble"]
