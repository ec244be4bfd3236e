"""Turning read results into a batch: one copy into writable torch tensors.

Deep Lake hands out read-only zero-copy views. ``torch.from_numpy`` on them warns, and a tensor that
aliases the store's buffer is unsafe to modify, so the batch tensor is allocated once and every sample
is copied into it exactly once. This runs on the loader's CPU pool, never on the loop thread.

Batch tensors come from ``runtime.alloc.allocate`` (the heap, or shared memory in a fan-out worker).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import CollateError
from ..runtime.alloc import allocate, on_heap

Sample = dict[str, Any]
Transform = Callable[[Sample], Any]
CollateFn = Callable[[list[Any]], Any]


#: What to do with a column whose samples differ in shape within a batch: ``"list"`` gives a list of
#: tensors, ``"pad"`` pads them with zeros to the batch's largest shape and adds ``"<column>_mask"``
#: (True where a value is real). Equal shapes always stack; strings always come back as a list.
Ragged = str  # "list" | "pad"
RaggedSpec = Mapping[str, Ragged] | Ragged | None
RAGGED = ("list", "pad")


def ragged_policy(spec: RaggedSpec, column: str) -> Ragged | None:
    if spec is None or isinstance(spec, str):
        return spec
    return spec.get(column)


def _stack_into(
    column: str, parts: Sequence[np.ndarray | Sequence[Any]], count: int, indices: Sequence[int]
) -> torch.Tensor:
    """Stack ``parts`` (arrays stacked on axis 0, or lists of arrays) into one new tensor of ``count`` rows."""
    first = parts[0][0]
    if not isinstance(first, np.ndarray):
        first = np.asarray(first)
    shape, dtype = first.shape, first.dtype
    out = allocate((count, *shape), _torch_dtype(column, dtype))
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
                    f"{indices[0]} has {shape}; samples of different shapes need ragged={{{column!r}: 'list' "
                    f"or 'pad'}}, a transform that resizes them, or a collate_fn"
                )
            view[row] = arr
            row += 1
    return out


def _torch_dtype(column: str, dtype: np.dtype) -> torch.dtype:
    try:
        return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
    except TypeError as exc:
        raise CollateError(f"column {column!r}: dtype {dtype} has no torch equivalent; pass a collate_fn") from exc


def _uniform(parts: Sequence[Any]) -> bool:
    """True when every part is an ndarray of one trailing shape and dtype (the common, fast case)."""
    if not all(isinstance(p, np.ndarray) for p in parts):
        return False
    first = parts[0]
    return all(p.shape[1:] == first.shape[1:] and p.dtype == first.dtype for p in parts)


def collate_column(
    column: str, parts: Sequence[Any], count: int, indices: Sequence[int], ragged: Ragged | None
) -> dict[str, Any]:
    """One column of a batch: ``{column: value}``, plus ``{column}_mask`` when padded.

    Equal shapes stack into one new tensor; strings stay a list of ``str``; unequal shapes follow
    ``ragged`` (a list of tensors, or zero padding with a mask) or raise ``CollateError``.
    """
    if _uniform(parts):
        return {column: _stack_into(column, parts, count, indices)}
    values = [v for p in parts for v in p]
    if values and all(isinstance(v, (str, bytes)) for v in values):
        return {column: list(values)}
    arrays = [np.asarray(v) for v in values]
    shapes = {a.shape for a in arrays}
    if len(shapes) == 1 or ragged is None:
        return {column: _stack_into(column, [arrays], count, indices)}
    dtype = _torch_dtype(column, arrays[0].dtype)
    if ragged == "list":
        return {column: [torch.from_numpy(np.array(a)) for a in arrays]}  # np.array copies: writable
    ndim = {len(s) for s in shapes}
    if len(ndim) != 1:
        raise CollateError(
            f"column {column!r}: samples have different numbers of dimensions {sorted(shapes)}; cannot pad"
        )
    big = tuple(max(dims) for dims in zip(*shapes, strict=True))
    out = allocate((count, *big), dtype)
    out.zero_()
    view = out.numpy()
    mask = torch.zeros((count, *big), dtype=torch.bool)
    for row, a in enumerate(arrays):
        region = (row, *(slice(0, n) for n in a.shape))
        view[region] = a  # one copy, numpy to numpy: the store's views are read-only
        mask[region] = True
    return {column: out, f"{column}_mask": mask}


def collate_columns(
    columns: Sequence[str],
    parts: Sequence[Mapping[str, Any]],
    indices: Sequence[int],
    with_index: bool,
    ragged: RaggedSpec = None,
) -> dict[str, Any]:
    """The default batch: ``{column: tensor [B, ...]}`` (plus ``"index"``) from columnar read results."""
    batch: dict[str, Any] = {}
    for c in columns:
        batch.update(collate_column(c, [p[c] for p in parts], len(indices), indices, ragged_policy(ragged, c)))
    if with_index:
        batch["index"] = torch.tensor(list(indices), dtype=torch.int64)
    return batch


def default_collate(samples: list[Any], ragged: RaggedSpec = None) -> Any:
    """Collate per-sample results (after a transform): dicts of arrays/tensors/numbers become dicts of
    stacked tensors (arrays of unequal shapes as ``ragged`` says, strings as lists); anything else goes
    to ``torch.utils.data.default_collate``."""
    if samples and all(isinstance(s, Mapping) for s in samples):
        keys = list(samples[0].keys())
        out: dict[str, Any] = {}
        for k in keys:
            vals = [s[k] for s in samples]
            if all(isinstance(v, np.ndarray) for v in vals) or all(isinstance(v, str) for v in vals):
                idx = [int(s.get("index", i)) for i, s in enumerate(samples)]
                out.update(collate_column(k, [vals], len(vals), idx, ragged_policy(ragged, k)))
            elif all(isinstance(v, torch.Tensor) for v in vals):
                first = vals[0]
                same = all(v.shape == first.shape and v.dtype == first.dtype and v.device.type == "cpu" for v in vals)
                if not on_heap() and same:  # stack straight into the chosen memory
                    out[k] = torch.stack(vals, out=allocate((len(vals), *first.shape), first.dtype))
                else:
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
