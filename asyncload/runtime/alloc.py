"""Where batch tensors are allocated: one process-wide setting, below both the collate functions and the
image decoders that write into the batch.

Ordinary heap memory by default; a fan-out worker process allocates in shared memory instead
(``set_allocator``), so that handing a batch to the training process copies no pixel data a second time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

#: ``(shape, dtype) -> new uninitialised tensor``: where batch tensors live.
Allocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


#: torch dtypes whose batch tensors are allocated through numpy (``heap_empty``).
_NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {
    t: np.dtype(n)
    for t, n in [
        (torch.uint8, "uint8"), (torch.int8, "int8"), (torch.int16, "int16"), (torch.int32, "int32"),
        (torch.int64, "int64"), (torch.float16, "float16"), (torch.float32, "float32"),
        (torch.float64, "float64"), (torch.bool, "bool"),
    ]
}  # fmt: skip


def heap_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The default allocator: this process's heap, through numpy wherever numpy has the dtype.

    A batch tensor is a few MB, allocated on a decode thread, written once, freed by the consumer. Through
    ``torch.empty`` such a block comes back in fresh pages, and the decode that writes it takes a page
    fault every few KB; numpy's allocator reuses freed blocks and asks the kernel for transparent huge
    pages on large ones, so the same writes fault far less often (benchmarks/results/first_epoch).
    The tensor shares the array's memory; unlike ``torch.empty``'s, its storage cannot be resized."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(np.empty(shape, np_dtype))


_allocate: Allocator = heap_empty


def set_allocator(allocator: Allocator | None) -> Allocator:
    """Make ``allocator`` allocate every batch tensor this module creates in this process (``None``: the
    heap again); returns the previous one. Process-wide on purpose: the loader calls the collate functions
    on its CPU pool, out of reach of any argument, and only a process that exists to ship batches to
    another one (a fan-out worker) wants anything but the heap."""
    global _allocate
    previous, _allocate = _allocate, allocator or heap_empty
    return previous


def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new batch tensor where this process keeps them (see ``set_allocator``)."""
    return _allocate(shape, dtype)


def on_heap() -> bool:
    """Whether batch tensors go to this process's heap (no allocator was set): then a plain
    ``torch.stack`` is as good as stacking into ``allocate``'s tensor."""
    return _allocate is heap_empty


__all__ = ["Allocator", "allocate", "heap_empty", "on_heap", "set_allocator"]
