"""asyncload: feed PyTorch from remote tensor stores with an asyncio pipeline on a background thread.

Public API::

    from asyncload import DeepLakeSource, AsyncLoader, AsyncIterableDataset

    src = DeepLakeSource("file:///data/seg", columns=("images", "masks"))
    for batch in AsyncLoader(src, batch_size=32, shuffle=True, seed=0, concurrency=256):
        batch["images"]  # uint8 [B, H, W, 3], writable
"""

from ._version import __version__
from .config import load_config
from .dataset import AsyncIterableDataset
from .device import DeviceFeed
from .epoch import Epoch, EpochIterator
from .errors import (
    AsyncLoadError,
    ColumnNotFoundError,
    ConfigError,
    DatasetNotFoundError,
    ReaderCrashError,
    ReadError,
    RemoteError,
    SourceError,
    WorkerError,
)
from .image.augment import RandomHorizontalFlip, RandomResizedCrop, Resize
from .image.codecs import DecodeError
from .loader import AsyncLoader
from .options import LoaderOptions
from .sampler import EpochSampler, Shard
from .sources._store import BucketNotFoundError, StoreAccessError, StoreEndpointError
from .sources.base import Source
from .sources.deeplake import DeepLakeSource
from .sources.objectstore import ObjectStoreSource
from .sources.subset import RangeSource
from .synthetic import make_dataset

__all__ = [
    "BucketNotFoundError",
    "StoreAccessError",
    "StoreEndpointError",
    "__version__",
    "AsyncIterableDataset",
    "AsyncLoadError",
    "AsyncLoader",
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
    "ObjectStoreSource",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "RangeSource",
    "ReadError",
    "RemoteError",
    "Resize",
    "Shard",
    "Source",
    "SourceError",
    "ReaderCrashError",
    "WorkerError",
    "load_config",
    "make_dataset",
]
