"""A private, empty node block store for one measured run: how a comparison starts cold.

Why: asyncload keeps the rows it fetched on local disk (``nodestore``), shared by every process,
every later epoch and every later run on the machine. A comparison that reads the same dataset twice, or
a second ``asyncload load`` of it, would time the second read from that disk and call it the network's.
So every run that reports a first epoch (``asyncload load``, ``make run``, the benchmark suites) reads
through a store of its own: a new, empty directory, removed when the run ends.

Where: beside the user's store (the parent of ``nodestore.default_root()``: ``~/.cache/asyncload``, or
the parent of ``$ASYNCLOAD_CACHE_DIR``), so that the disk the run writes to is the one a user's first
epoch writes to; where that cannot be written, the temp directory (``$TMPDIR``). Never inside the store's
own root, whose subdirectories are datasets' shelves that the store may evict.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

PREFIX = "asyncload-cold-"


def new_cold_dir(prefix: str = PREFIX) -> str:
    """A new, empty directory for a node store: beside the default store, else under ``$TMPDIR``."""
    from ..nodestore import default_root

    root = default_root()
    if root is None:  # no local disk for the store here: the run reads through, as a user's would
        return tempfile.mkdtemp(prefix=prefix)
    base = root.expanduser().parent
    try:
        base.mkdir(parents=True, exist_ok=True)
        return tempfile.mkdtemp(prefix=prefix, dir=base)
    except OSError:  # a read-only home, a root-owned parent of $ASYNCLOAD_CACHE_DIR: the temp dir
        return tempfile.mkdtemp(prefix=prefix)


@contextlib.contextmanager
def cold_cache_dir(prefix: str = PREFIX, *, env: bool = False) -> Iterator[str]:
    """A new, empty node-store directory for the ``with`` block, removed after (whatever happened).

    Pass it as ``cache_dir=`` to the run's loader; or ``env=True``, for loaders made elsewhere (in a
    child process, a suite's reader): ``$ASYNCLOAD_CACHE_DIR`` names it for the block, and what it was
    before is put back after. Processes started inside the block inherit it."""
    path = new_cold_dir(prefix)
    before = os.environ.get("ASYNCLOAD_CACHE_DIR")
    if env:
        os.environ["ASYNCLOAD_CACHE_DIR"] = path
    try:
        yield path
    finally:
        if env:
            if before is None:
                os.environ.pop("ASYNCLOAD_CACHE_DIR", None)
            else:
                os.environ["ASYNCLOAD_CACHE_DIR"] = before
        shutil.rmtree(path, ignore_errors=True)


def dir_bytes(path: str | Path) -> int:
    """Bytes of the files under ``path`` (what a run's store kept), 0 where it is gone."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


__all__ = ["PREFIX", "cold_cache_dir", "dir_bytes", "new_cold_dir"]
