"""asyncload: feed PyTorch from remote tensor stores with an asyncio pipeline on a background thread.

Public API::

    from asyncload import DeepLakeSource, AsyncLoader, AsyncIterableDataset

    src = DeepLakeSource("file:///data/seg", columns=("images", "masks"))
    for batch in AsyncLoader(src, batch_size=32, shuffle=True, seed=0, concurrency=256):
        batch["images"]  # uint8 [B, H, W, 3], writable

Names are imported on first use (PEP 562): ``import asyncload`` costs no torch import, so that a process
that needs only a source (an isolated reader, ``asyncload.sources``) starts without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    AsyncLoadError,
    BucketNotFoundError,
    CollateError,
    ColumnNotFoundError,
    ConfigError,
    DatasetNotFoundError,
    DecodeError,
    LoaderClosedError,
    RanksDisagreeError,
    ReaderCrashError,
    ReadError,
    RemoteError,
    SourceError,
    StallError,
    StoreAccessError,
    StoreEndpointError,
    WorkerError,
)

if TYPE_CHECKING:
    from .dataset import AsyncIterableDataset
    from .device import DeviceFeed
    from .engine.epoch import Epoch, EpochIterator
    from .engine.options import LoaderOptions
    from .engine.sampler import EpochSampler, Shard
    from .engine.statslog import StatsLogger
    from .image.augment import RandomHorizontalFlip, RandomResizedCrop, Resize
    from .loader import AsyncLoader
    from .runtime.settings import load_config
    from .sources.base import Source
    from .sources.deeplake import DeepLakeSource
    from .sources.mixed import MixedSource
    from .sources.objectstore import ObjectStoreSource
    from .sources.stores.http import Timeouts
    from .sources.stores.retry import RetryPolicy
    from .sources.subset import RangeSource
    from .tools.synthetic import make_dataset

#: where each public name that costs an import is defined
_LAZY = {
    "load_config": ".runtime.settings",
    "AsyncIterableDataset": ".dataset",
    "DeviceFeed": ".device",
    "Epoch": ".engine.epoch",
    "EpochIterator": ".engine.epoch",
    "RandomHorizontalFlip": ".image.augment",
    "RandomResizedCrop": ".image.augment",
    "Resize": ".image.augment",
    "AsyncLoader": ".loader",
    "LoaderOptions": ".engine.options",
    "RetryPolicy": ".sources.stores.retry",
    "Timeouts": ".sources.stores.http",
    "EpochSampler": ".engine.sampler",
    "Shard": ".engine.sampler",
    "StatsLogger": ".engine.statslog",
    "Source": ".sources.base",
    "DeepLakeSource": ".sources.deeplake",
    "ObjectStoreSource": ".sources.objectstore",
    "RangeSource": ".sources.subset",
    "MixedSource": ".sources.mixed",
    "make_dataset": ".tools.synthetic",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncload' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "BucketNotFoundError",
    "StoreAccessError",
    "StoreEndpointError",
    "__version__",
    "AsyncIterableDataset",
    "AsyncLoadError",
    "AsyncLoader",
    "CollateError",
    "ColumnNotFoundError",
    "ConfigError",
    "DatasetNotFoundError",
    "DecodeError",
    "DeepLakeSource",
    "DeviceFeed",
    "Epoch",
    "EpochIterator",
    "EpochSampler",
    "LoaderOptions",
    "MixedSource",
    "ObjectStoreSource",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RangeSource",
    "ReadError",
    "RemoteError",
    "Resize",
    "RetryPolicy",
    "Shard",
    "Source",
    "SourceError",
    "ReaderCrashError",
    "RanksDisagreeError",
    "StallError",
    "StatsLogger",
    "LoaderClosedError",
    "Timeouts",
    "WorkerError",
    "load_config",
    "make_dataset",
]
