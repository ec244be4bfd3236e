"""The training job's data: one split of the dataset per loader, asyncload or the synchronous baseline.

Each split is a row range (``sources.subset.RangeSource``), so the sampler shards only that range across ranks
and workers and each split has its own exact epoch."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..dataset import AsyncIterableDataset
from ..loader import AsyncLoader
from ..sampler import EpochSampler, Shard
from ..sources.deeplake import DeepLakeSource
from ..sources.subset import RangeSource
from ..state import EpochProgress, with_progress
from .config import TrainConfig


class SyncSegmentation(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The baseline: rows ``[start, stop)`` read one by one with ``ds[i]["images"]``, ``ds[i]["masks"]``.

    The Deep Lake handle is opened lazily in the process that reads (DataLoader workers included), with
    ``creds`` for a dataset on an object store. ``benchmarks/scaling.py`` measures the same baseline."""

    def __init__(self, url: str, start: int, stop: int, creds: dict[str, str] | None = None) -> None:
        self.url, self.start, self.stop, self.creds = url, start, stop, creds
        self._ds: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._pid != os.getpid():
            import deeplake

            self._ds, self._pid = deeplake.open_read_only(self.url, creds=self.creds), os.getpid()
        row = self._ds[self.start + i]
        return {
            "images": torch.from_numpy(np.array(row["images"])),
            "masks": torch.from_numpy(np.array(row["masks"])),
            "index": self.start + i,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ds": None, "_pid": -1}


class Split:
    """One split's batches per epoch through the chosen loader, the same on every rank: equal batch
    counts, and how many of this rank's samples are real (not padding) for exact evaluation."""

    def __init__(
        self, cfg: TrainConfig, url: str, start: int, stop: int, *, train: bool, rank: int, world: int
    ) -> None:
        self.n, self.rank, self.world = stop - start, rank, world
        self.dataset: Any
        self.sampler: Any = None
        if cfg.loader == "asyncload":
            source = RangeSource(DeepLakeSource(url), start, stop)
            how: dict[str, Any] = dict(
                batch_size=cfg.batch_size, shuffle=train, seed=cfg.seed, concurrency=cfg.concurrency,
                prefetch=cfg.prefetch, remainder="pad",
            )  # fmt: skip
            if cfg.processes and train:
                # K persistent worker processes, started by the first epoch and kept across epochs; the
                # held-out split is small and read once per epoch, in this process.
                loader = AsyncLoader(source, processes=cfg.processes, rank=rank, world_size=world, **how)
                self.dataset = self.loader = TrainedPrefix(loader)
            else:
                self.dataset = AsyncIterableDataset(source, **how)
                self.loader = torch.utils.data.DataLoader(self.dataset, batch_size=None, num_workers=cfg.num_workers)
            per = EpochSampler(self.n, 1, remainder="pad", shard=Shard(rank, world)).rank_samples
            self.real = max(0, min(per, self.n - rank * per))
        else:
            self.dataset = SyncSegmentation(url, start, stop)
            self.sampler = torch.utils.data.DistributedSampler(
                self.dataset, num_replicas=world, rank=rank, shuffle=train, seed=cfg.seed
            )
            self.loader = torch.utils.data.DataLoader(
                self.dataset, batch_size=cfg.batch_size, sampler=self.sampler, num_workers=cfg.num_workers
            )
            self.real = len(range(rank, self.n, world))  # DistributedSampler pads at the end of each share

    def __len__(self) -> int:
        return len(self.loader)

    def epoch(self, epoch: int) -> Iterator[Any]:
        (self.sampler or self.dataset).set_epoch(epoch)
        return iter(self.loader)

    def close(self) -> None:
        """Stop the loader's worker processes, if it has its own (``processes=K``)."""
        close = getattr(self.loader, "close", None)
        if callable(close):
            close()


class TrainedPrefix:
    """An in-order ``AsyncLoader`` whose resume state counts the batches the training loop *trained*.

    ``DeviceFeed`` takes batches a step or two ahead of the step that trains them, so the loader's own
    ``state_dict()`` would count those too, and a resume would skip them. In order, the batches trained
    are the first ``batches_consumed`` of the epoch's plan, which is what the state says here."""

    def __init__(self, loader: AsyncLoader) -> None:
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def state_dict(self, batches_consumed: int) -> dict[str, Any]:
        state = self.loader.state_dict()
        return with_progress(state, EpochProgress(state["epoch"], state["total"], batches_consumed))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        self.loader.close()


def first_n(it: Iterator[Any], n: int) -> Iterator[Any]:
    """The first ``n`` items of ``it``; closing this generator drops ``it`` (stopping its workers)."""
    try:
        for k, item in enumerate(it):
            if k >= n:
                break
            yield item
    finally:
        close = getattr(it, "close", None)
        if callable(close):
            close()
        del it
