"""Gather writes: many buffers to one file descriptor in a few ``writev`` calls, where a write call per
buffer cost more than the copy. Shared by the reader process's answers (a socket, which takes what its
buffer holds) and the node store's parts (a file)."""

from __future__ import annotations

import os
from collections.abc import Sequence

#: Buffers per ``writev`` call: Linux's IOV_MAX.
IOV_MAX = 1024


def write_all(fd: int, bufs: Sequence[bytes | bytearray | memoryview]) -> None:
    """Every byte of ``bufs`` to ``fd``, in order: ``os.writev`` again after a short write, from where it
    stopped (empty buffers are passed over)."""
    todo = [memoryview(b).cast("B") for b in bufs]  # (byte offsets, whatever the buffer's item size)
    while todo:
        n = os.writev(fd, todo[:IOV_MAX])
        while todo and n >= todo[0].nbytes:
            n -= todo.pop(0).nbytes
        if todo and n:
            todo[0] = todo[0][n:]
