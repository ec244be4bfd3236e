"""What users run without asyncload: a map-style Dataset in torch's DataLoader.

- ``sync``: ``SyncSegDataset``, whose ``__getitem__`` reads ``ds[i]["images"]`` and ``ds[i]["masks"]``
  (two blocking reads; Deep Lake decodes), optionally through a per-sample transform
  (``transforms.py``); each worker opens the dataset from its URL;
- ``pytorch``: Deep Lake's own ``ds.pytorch()``.

Workers start with the spec's ``start`` method: ``fork`` where the suite leaves it (no read is in flight
when the DataLoader starts them, and spawn would add ~5–10 s of imports per run on 2 cores), ``spawn``
where the issue asks for it (the augmentation suite: what a user with CUDA must use).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch.utils.data

from . import transforms
from .common import open_dataset

BATCH = 32


class SyncSegDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """One sample per ``__getitem__``: two blocking reads (image, mask), copied to writable arrays, then
    ``transform`` if given. The dataset handle is opened lazily per process (it cannot be pickled)."""

    def __init__(self, url: str, creds: dict[str, str] | None = None, transform: Callable[..., Any] | None = None) -> None:  # fmt: skip
        self.url, self.creds, self.transform = url, creds, transform
        self._ds: Any = None
        self._pid: int | None = None
        self._len = len(self._open())

    def _open(self) -> Any:
        if self._ds is None or self._pid != os.getpid():
            self._ds = open_dataset({"url": self.url, "creds": self.creds}, pool=None)
            self._pid = os.getpid()
        return self._ds

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ds": None, "_pid": None}

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self._open()[int(i)]
        sample = {"images": np.array(row["images"]), "masks": np.array(row["masks"])}
        return self.transform(sample) if self.transform is not None else sample


def deeplake_pytorch(url: str, creds: dict[str, str] | None = None) -> torch.utils.data.Dataset:  # type: ignore[type-arg]
    """Deep Lake's own torch dataset for ``url`` (``ds.pytorch()``), pickled by URL into workers."""
    return open_dataset({"url": url, "creds": creds}, pool=None).pytorch()


def batches(spec: dict[str, Any], order: list[int]) -> Iterator[Any]:
    from torch.utils.data import DataLoader

    url, creds, workers = spec["url"], spec.get("creds"), spec.get("workers", 0)
    if spec["reader"] == "sync":
        name = spec.get("options", {}).get("transform")
        ds = SyncSegDataset(url, creds, transforms.named(name) if name else None)
    else:
        ds = deeplake_pytorch(url, creds)
    start = spec.get("options", {}).get("start", "fork")
    return iter(
        DataLoader(
            ds, batch_size=BATCH, sampler=order, num_workers=workers, multiprocessing_context=start if workers else None
        )
    )
