"""A child process's target that imports numpy and nothing else (``test_isolation``'s BLAS thread check)."""

from __future__ import annotations

import os

import numpy  # noqa: F401 - what is measured: the threads its import starts


def count_threads(conn, environ) -> None:
    """``runtime.procs.start_child``'s target: how many threads this process runs once numpy is imported (the
    unpickling of this function imported this module, and numpy with it)."""
    conn.send(len(os.listdir("/proc/self/task")))
    conn.close()
