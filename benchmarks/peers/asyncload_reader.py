"""asyncload as a user writes it: ``AsyncLoader(DeepLakeSource(url, creds=...), 32, shuffle=...)`` with
whatever options the spec names (none: the defaults).

Options come as data (YAML configs, a pickled spec) and are built here, in the measured process:
``augment: [[RandomResizedCrop, {size: 256, ...}], [RandomHorizontalFlip, {p: 0.5}]]`` names ops of
``asyncload``; ``transform: <name>`` names a per-sample callable of ``transforms.py``;
``storage_concurrency`` goes to the source, everything else to the loader.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

from . import harness, transforms

BATCH = 32
_SOURCE_OPTIONS = ("storage_concurrency",)


def build_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(source options, loader options) with ``augment`` and ``transform`` made into objects."""
    import asyncload

    source = {k: v for k, v in options.items() if k in _SOURCE_OPTIONS}
    loader = {k: v for k, v in options.items() if k not in _SOURCE_OPTIONS}
    if "augment" in loader:
        loader["augment"] = [getattr(asyncload, name)(**kw) for name, kw in loader["augment"]]
    if "transform" in loader:
        loader["transform"] = transforms.named(loader["transform"])
    return source, loader


def batches(spec: dict[str, Any], order: list[int]) -> Iterator[Any]:
    """The loader's own shuffle (seed 0) for a shuffled spec: asyncload is told ``shuffle``, not the order."""
    from asyncload import AsyncLoader, DeepLakeSource

    began = time.perf_counter()
    options = dict(spec.get("options", {}))
    os.environ.update(options.pop("env", {}))  # (A/B runs of a setting read from the environment)
    source_opts, loader_opts = build_options(options)
    src = DeepLakeSource(spec["url"], creds=spec.get("creds"), **source_opts)
    loader = AsyncLoader(src, batch_size=BATCH, shuffle=spec["order"] != "sequential", seed=0, **loader_opts)
    built = time.perf_counter()

    def stats() -> dict[str, Any]:
        st = loader.stats()
        first = st.get("time_to_first_read_s")  # from the epoch's start: the first ``next()``, just after
        st["first_read_at_s"] = None if first is None else built - began + first
        return st

    harness.LIVE["stats"] = stats
    return iter(loader)
