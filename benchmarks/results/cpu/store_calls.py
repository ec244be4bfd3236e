"""CPU of the node store's calls in place: one cold epoch with the store on, each call timed with
``time.thread_time`` (the CPU of the thread that made it).

    .venv/bin/python benchmarks/results/cpu/store_calls.py data/bench/photos-4000-jpg [zlib]

``zlib``: the values' CRC32 by ``zlib.crc32`` instead of ``nodestore.checksum``'s (ISA-L's where installed).
"""

from __future__ import annotations

import collections
import functools
import sys
import time
import zlib
from typing import Any

from asyncload import AsyncLoader, DeepLakeSource
from asyncload.nodestore import parts, shelf, store
from asyncload.tools.coldstore import cold_cache_dir

CPU: dict[str, float] = collections.defaultdict(float)
CALLS: collections.Counter[str] = collections.Counter()


def timed(owner: Any, name: str, label: str) -> None:
    f = getattr(owner, name)

    @functools.wraps(f)
    def call(*a: Any, **k: Any) -> Any:
        t = time.thread_time()
        try:
            return f(*a, **k)
        finally:
            CPU[label] += time.thread_time() - t
            CALLS[label] += 1

    setattr(owner, name, call)


def timed_crc(impl: Any) -> Any:
    """``impl`` (a ``crc32``) as ``nodestore.shelf`` calls it, timed."""

    def crc32(*a: Any) -> int:
        t = time.thread_time()
        try:
            return impl(*a)
        finally:
            CPU["crc32"] += time.thread_time() - t
            CALLS["crc32"] += 1

    return crc32


def main(url: str, impl: str) -> None:
    for owner, name in [(shelf.Shelf, "put"), (shelf.Shelf, "lookup"), (shelf.Shelf, "claim"),
                        (shelf.Shelf, "unclaim"), (store.NodeStore, "reserve"), (parts.Parts, "write")]:  # fmt: skip
        timed(owner, name, f"{owner.__name__}.{name}")
    shelf.crc32 = timed_crc(zlib.crc32 if impl == "zlib" else shelf.crc32)  # type: ignore[assignment]
    with cold_cache_dir() as cache:
        loader = AsyncLoader(DeepLakeSource(url), batch_size=32, shuffle=True, seed=0, cache_dir=cache, cache=True)
        n = sum(len(b["index"]) for b in loader)
        loader.close()
    for k, v in sorted(CPU.items(), key=lambda kv: -kv[1]):
        print(f"{k:16s} {1000 * v / n:.4f} ms/sample  {CALLS[k]:6d} calls  {1000 * v / max(CALLS[k], 1):.3f} ms/call")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "default")
