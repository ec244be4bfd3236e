"""Where batch tensors are allocated: one process-wide setting, below both the collate functions and the
image decoders that write into the batch.

Ordinary heap memory by default; a fan-out worker process allocates in shared memory instead
(``set_allocator``), so that handing a batch to the training process copies no pixel data a second time.

On the heap, the memory of a batch the consumer has let go of is kept for the next batch of the same size
(``_Spares``): a fresh block of a few MB comes back from the kernel as pages that are zeroed as the decode
first writes them (a 2 MB huge page at a time), which cost the decode threads more CPU than the lz4 masks'
decompression (benchmarks/results/cpu/).
"""

from __future__ import annotations

import os
import threading
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


class _Lease:
    """The owner of one spare buffer while a batch tensor, or anything that views its memory, lives.

    numpy takes it as the base of the array it makes from ``__array_interface__``, and views of that array
    (numpy's, torch's, ``Tensor.numpy()``) keep the array, so the lease outlives every one of them; its
    ``__del__`` hands the buffer back only then. Keeping the buffer in the array's own ``base`` would not do:
    numpy makes a view's base the buffer itself, which would let a view outlive its lease."""

    __slots__ = ("__array_interface__", "buf", "spares")

    def __init__(self, buf: np.ndarray, shape: tuple[int, ...], dtype: np.dtype[Any], spares: _Spares) -> None:
        self.buf, self.spares = buf, spares
        self.__array_interface__ = {
            "version": 3,
            "shape": shape,
            "typestr": dtype.str,
            "data": (buf.ctypes.data, False),
        }

    def __del__(self) -> None:
        self.spares.give(self.buf)


class _Spares:
    """Buffers of batches that nothing refers to any more, by size, for the next batch of that size.

    Bounded: at most ``per_size`` buffers of one size and ``limit`` bytes in all; a buffer given back past
    either is freed. Eight of a size: the decode threads run ahead of the consumer in bursts (a block's rows
    arrive together), and with two a third of a cold JPEG epoch's batches still came to fresh memory
    (benchmarks/results/cpu/). What is kept is what the pipeline held before, within its memory budget; a
    batch whose size has no spare gets a new buffer. ``give`` runs in a finaliser, on whichever thread let go
    of the batch last, so it never waits for the lock: where another thread holds it, the buffer is freed
    instead."""

    def __init__(self, per_size: int = 8, limit: int = 128 << 20) -> None:
        self.per_size, self.limit = per_size, limit
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}
        self._bytes = 0
        #: batches given a spare, and given new memory: for tests and benchmarks.
        self.reused = self.fresh = 0

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """An uninitialised array of ``shape`` and ``dtype``: a spare's memory where one fits exactly."""
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0 or nbytes > self.limit:
            return np.empty(shape, dtype)
        buf = None
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                buf = free.pop()
                self._bytes -= nbytes
                if not free:
                    del self._free[nbytes]
                self.reused += 1
            else:
                self.fresh += 1
        if buf is None:
            buf = np.empty(nbytes, np.uint8)
        return np.asarray(_Lease(buf, shape, dtype, self))

    def give(self, buf: np.ndarray) -> None:
        if not self._lock.acquire(blocking=False):
            return
        try:
            free = self._free.get(buf.nbytes, [])
            if len(free) < self.per_size and self._bytes + buf.nbytes <= self.limit:
                free.append(buf)
                self._free[buf.nbytes] = free
                self._bytes += buf.nbytes
        finally:
            self._lock.release()

    def clear(self) -> None:
        """Free every spare."""
        with self._lock:
            self._free.clear()
            self._bytes = 0

    def after_fork(self) -> None:
        """In a forked child: a lock of its own (the parent's may have been held by a thread the child does
        not have) and no spares (the parent's, copied on write, are not worth the copies)."""
        self._lock = threading.Lock()
        self._free = {}
        self._bytes = 0


_spares = _Spares()
os.register_at_fork(after_in_child=_spares.after_fork)


def heap_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The default allocator: this process's heap, through numpy wherever numpy has the dtype.

    A batch tensor is a few MB, allocated on a decode thread, written once, freed by the consumer. Through
    ``torch.empty`` such a block comes back in fresh pages, and the decode that writes it takes a page
    fault every few KB; numpy's allocator asks the kernel for transparent huge pages on large ones, so the
    same writes fault far less often (benchmarks/results/first_epoch), and a spare (``_Spares``) not at all.
    The tensor shares the array's memory; unlike ``torch.empty``'s, its storage cannot be resized."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(_spares.take(tuple(shape), np_dtype))


def release_spares() -> None:
    """Free the memory kept for batches to come (``_Spares``): when a loader closes."""
    _spares.clear()


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


__all__ = ["Allocator", "allocate", "heap_empty", "on_heap", "release_spares", "set_allocator"]
