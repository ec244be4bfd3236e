"""The readers the suites compare, one module each, all measured by one harness (``harness.py``).

Every reader takes the same ``spec`` (dataset URL, credentials, index order, options) and yields batches
of images and masks as torch tensors (``{"images": [B, H, W, 3], "masks": [B, H, W] or [B, H, W, 1]}``),
written the way a user would write it, so that a row of a table is a reader a user could have instead
(``column`` and ``bytes`` take a ``pool`` option: Deep Lake's storage pool, 64 without it):

=================  ====================================================================================
``column``         plain Deep Lake reader: column ``get_async`` of 64 indices, 4 in flight, pool 64
``ceiling``        the same on a local copy: what hiding all latency would reach
``bytes``          the hand-written bytes reader: ``get_bytes_async`` + simplejpeg (OpenCV for PNG) on 2 threads;
                   options ``masks: bytes`` (lz4 masks as stored bytes + python-lz4), ``png: spng`` (libspng)
``spdl``           SPDL 0.8: per-row ``get_async`` at concurrency 64, pool 64
``asyncload``      ``AsyncLoader`` with the options the spec names (none: the defaults)
``sync``           a map-style Dataset (``ds[i][col]``, optionally a per-sample transform) in a DataLoader
``pytorch``        Deep Lake's ``ds.pytorch()`` in a DataLoader
``augref``         the augmentation reference: bytes + simplejpeg (scaled decode) + OpenCV crop/resize/flip
=================  ====================================================================================
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any

#: reader name -> module in this package with ``batches(spec, order) -> Iterator[batch]``
MODULES: dict[str, str] = {
    "column": "deeplake_column",
    "ceiling": "deeplake_column",
    "bytes": "bytes_jpeg",
    "spdl": "spdl",
    "asyncload": "asyncload_reader",
    "sync": "dataloader",
    "pytorch": "dataloader",
    "augref": "augment_reference",
}


def batches(spec: dict[str, Any], order: list[int]) -> Iterator[Any]:
    """The iterator of the reader ``spec["reader"]`` names, over ``order``."""
    name = spec["reader"]
    if name not in MODULES:
        raise ValueError(f"unknown reader {name!r}; known: {', '.join(MODULES)}")
    module = importlib.import_module(f"{__name__}.{MODULES[name]}")
    return module.batches(spec, order)


def modules() -> list[str]:
    """Every reader module's import name: what a forkserver preloads so each run starts warm."""
    return [f"{__name__}.{m}" for m in dict.fromkeys(MODULES.values())]
