"""Turning read results into a batch: one copy into writable torch tensors.

Deep Lake hands out read-only zero-copy views. ``torch.from_numpy`` on them warns, and a tensor that
aliases the store's buffer is unsafe to modify, so the batch tensor is allocated once and every sample
is copied into it exactly once. This runs on the loader's CPU pool, never on the loop thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .errors import AsyncLoadError

Sample = dict[str, Any]
Transform = Callable[[Sample], Any]
CollateFn = Callable[[list[Any]], Any]


class CollateError(AsyncLoadError, ValueError):
    """Samples of one column cannot be stacked into a batch tensor."""


def _stack_into(column: str, parts: Sequence[np.ndarray | Sequence[Any]], count: int, indices: Sequence[int]) -> torch.Tensor:
    """Stack ``parts`` (arrays stacked on axis 0, or lists of arrays) into one new tensor of ``count`` rows."""
    first = parts[0][0]
    if not isinstance(first, np.ndarray):
        first = np.asarray(first)
    shape, dtype = first.shape, first.dtype
    try:
        out = torch.empty((count, *shape), dtype=torch.from_numpy(np.empty(0, dtype=dtype)).dtype)
    except TypeError as exc:
        raise CollateError(f"column {column!r}: dtype {dtype} has no torch equivalent; pass a collate_fn") from exc
    view = out.numpy()
    row = 0
    for part in parts:
        if isinstance(part, np.ndarray) and part.shape[1:] == shape and part.dtype == dtype:
            view[row : row + len(part)] = part
            row += len(part)
            continue
        for arr in part:
            arr = np.asarray(arr)
            if arr.shape != shape:
                raise CollateError(
                    f"column {column!r}: sample at index {indices[row]} has shape {arr.shape}, but index "
                    f"{indices[0]} has {shape}; samples of different shapes need a transform that resizes "
                    f"them or a collate_fn"
                )
            view[row] = arr
            row += 1
    return out


def collate_columns(
    columns: Sequence[str], parts: Sequence[Mapping[str, Any]], indices: Sequence[int], with_index: bool
) -> dict[str, torch.Tensor]:
    """The default batch: ``{column: tensor [B, ...]}`` (plus ``"index"``) from columnar read results."""
    batch = {c: _stack_into(c, [p[c] for p in parts], len(indices), indices) for c in columns}
    if with_index:
        batch["index"] = torch.tensor(list(indices), dtype=torch.int64)
    return batch


def default_collate(samples: list[Any]) -> Any:
    """Collate per-sample results (after a transform): dicts of arrays/tensors/numbers become dicts of
    stacked tensors; anything else goes to ``torch.utils.data.default_collate``."""
    if samples and all(isinstance(s, Mapping) for s in samples):
        keys = list(samples[0].keys())
        out: dict[str, Any] = {}
        for k in keys:
            vals = [s[k] for s in samples]
            if all(isinstance(v, np.ndarray) for v in vals):
                out[k] = _stack_into(k, [vals], len(vals), [int(s.get("index", i)) for i, s in enumerate(samples)])
            elif all(isinstance(v, torch.Tensor) for v in vals):
                out[k] = torch.stack(vals)
            elif all(isinstance(v, (int, float, bool, np.number)) for v in vals):
                out[k] = torch.as_tensor(np.asarray(vals))
            else:
                out[k] = torch.utils.data.default_collate(vals)
        return out
    return torch.utils.data.default_collate(samples)


def rows(columns: Sequence[str], parts: Sequence[Mapping[str, Any]], indices: Sequence[int]) -> list[Sample]:
    """Split columnar read results into per-sample dicts (zero-copy, read-only views)."""
    samples: list[Sample] = []
    for part in parts:
        n = len(part[columns[0]])
        for j in range(n):
            samples.append({c: part[c][j] for c in columns})
    for s, i in zip(samples, indices, strict=True):
        s["index"] = i
    return samples
