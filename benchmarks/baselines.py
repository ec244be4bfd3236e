"""What users would run instead of asyncload, written plainly so the comparison is fair.

- ``SyncSegDataset``: the synchronous baseline, a map-style torch Dataset whose ``__getitem__`` reads
  ``ds[i]["images"]`` and ``ds[i]["masks"]``; DataLoader workers open the dataset from its URL.
- ``deeplake_pytorch``: Deep Lake's own ``ds.pytorch()`` map-style dataset.
- ``recipe.py`` beside this file: the published asyncio recipe, as published but bounded.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch.utils.data


class SyncSegDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """One sample per ``__getitem__``, two blocking reads (image, mask), copied to writable arrays."""

    def __init__(self, url: str, creds: dict[str, str] | None = None) -> None:
        self.url, self.creds = url, creds
        self._ds: Any = None
        self._pid: int | None = None
        self._len = len(self._open())

    def _open(self) -> Any:
        import deeplake

        if self._ds is None or self._pid != os.getpid():
            self._ds = (
                deeplake.open_read_only(self.url, creds=self.creds) if self.creds else deeplake.open_read_only(self.url)
            )
            self._pid = os.getpid()
        return self._ds

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ds": None, "_pid": None}

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        row = self._open()[int(i)]
        return {"images": np.array(row["images"]), "masks": np.array(row["masks"])}


def deeplake_pytorch(url: str, creds: dict[str, str] | None = None) -> torch.utils.data.Dataset:  # type: ignore[type-arg]
    """Deep Lake's own torch dataset for ``url`` (``ds.pytorch()``), pickled by URL into workers."""
    import deeplake

    ds = deeplake.open_read_only(url, creds=creds) if creds else deeplake.open_read_only(url)
    return ds.pytorch()
