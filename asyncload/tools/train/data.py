"""The training job's data: one split of the dataset per loader, asyncload or the synchronous baseline.

Each split is a row range (``sources.subset.RangeSource``), so the sampler shards only that range across ranks
and workers and each split has its own exact epoch.

Each split also has its augmentation (``split_augment``), which is what lets the job train on images of
many sizes: every sample comes out at one size, so batches stack. asyncload applies it in its decode
stage; the synchronous baseline applies the same draws per sample in Python (``SyncSegmentation``)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...dataset import AsyncIterableDataset
from ...engine.progress import EpochProgress, with_progress
from ...engine.sampler import EpochSampler, Shard
from ...errors import ConfigError
from ...image.augment import Augment, Draw, Op, RandomHorizontalFlip, RandomResizedCrop, Resize
from ...loader import AsyncLoader
from ...sources.deeplake import DeepLakeSource
from ...sources.subset import RangeSource
from .config import TrainConfig
from .model import UNet


def source_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    """``creds``, ``token`` and ``profile`` for ``DeepLakeSource`` from the config, as ``asyncload load``
    takes them: ``creds`` a JSON file, ``endpoint`` merged into it as ``endpoint_url``."""
    import json

    creds: dict[str, str] = {}
    if cfg.creds:
        with open(cfg.creds, encoding="utf-8") as f:  # a missing file is an OSError naming it
            try:
                creds = dict(json.load(f))
            except ValueError as exc:
                raise ConfigError(f"creds={cfg.creds!r} is not allowed: not valid JSON ({exc})") from None
    if cfg.endpoint:
        creds["endpoint_url"] = cfg.endpoint
    return {"creds": creds or None, "token": cfg.token, "profile": cfg.profile}


def dataset_source(cfg: TrainConfig, url: str, columns: Sequence[str] | None = None) -> DeepLakeSource:
    """The dataset at ``url`` with the config's credentials, reading its image and mask columns."""
    cols = tuple(columns) if columns is not None else (cfg.image_column, cfg.mask_column)
    return DeepLakeSource(url, cols, **source_kwargs(cfg))


def split_augment(cfg: TrainConfig, train: bool) -> list[Op]:
    """The split's augmentation: for training a random resized crop (``crop``) or a plain resize to
    ``image_size``, then a horizontal flip (``flip``); for validation the plain resize alone, so every
    epoch evaluates the same pixels. On data made at ``image_size`` the resize leaves images as stored."""
    ops: list[Op] = [Resize(cfg.image_size)]
    if train and cfg.crop is not None:
        ops = [RandomResizedCrop(cfg.crop, scale=cfg.crop_scale, ratio=cfg.crop_ratio)]
    if train and cfg.flip:
        ops.append(RandomHorizontalFlip(cfg.flip))
    return ops


def describe(ops: Sequence[Op]) -> str:
    """The augmentation in the words of the job's log line, e.g. ``crop 96x96 (scale 0.25-1, ratio
    0.75-1.333), flip 0.5``."""
    words = []
    for op in ops:
        if isinstance(op, RandomHorizontalFlip):
            words.append(f"flip {op.p:g}")
            continue
        h, w = (op.size, op.size) if isinstance(op.size, int) else op.size
        if isinstance(op, RandomResizedCrop):
            (s0, s1), (r0, r1) = op.scale, op.ratio
            words.append(f"crop {h}x{w} (scale {s0:g}-{s1:g}, ratio {r0:g}-{r1:g})")
        else:
            words.append(f"resize to {h}x{w}")
    return ", ".join(words)


def apply_draw(
    draw: Draw, image: np.ndarray, mask: np.ndarray, fills: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sample's ``Draw`` in torch: crop the box, resize it into ``inner`` (image antialiased bilinear,
    mask nearest, so class ids stay class ids), mirror, pad the rest with ``fills``. A draw that changes
    nothing (a resize to the stored size) costs nothing."""
    y, x, h, w = draw.box
    iy, ix, ih, iw = draw.inner
    img, msk = torch.from_numpy(image[y : y + h, x : x + w]), torch.from_numpy(mask[y : y + h, x : x + w])
    if (ih, iw) != (h, w):
        img = F.interpolate(img.permute(2, 0, 1)[None].float(), (ih, iw), mode="bilinear", antialias=True)
        img = img[0].permute(1, 2, 0).round().clamp(0, 255).to(torch.uint8)
        msk = F.interpolate(msk[None, None].float(), (ih, iw), mode="nearest-exact")[0, 0].to(torch.uint8)
    if draw.flip:
        img, msk = img.flip(1), msk.flip(1)
    if draw.inner == (0, 0, *draw.out):
        return img.contiguous(), msk.contiguous()
    out_img = torch.full((*draw.out, img.shape[2]), fills[0], dtype=torch.uint8)
    out_msk = torch.full(draw.out, fills[1], dtype=torch.uint8)
    out_img[iy : iy + ih, ix : ix + iw], out_msk[iy : iy + ih, ix : ix + iw] = img, msk
    return out_img, out_msk


def worker_start(num_workers: int) -> dict[str, Any]:
    """DataLoader workers by spawn: this process opened Deep Lake (the dataset's open, the class scan), whose
    runtime does not survive a fork (a forked worker segfaulted in about 1 run in 6: docs/ARCHITECTURE.md)."""
    return {"multiprocessing_context": "spawn"} if num_workers else {}


class SyncSegmentation(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The baseline: rows ``[start, stop)`` read one by one with ``ds[i]["images"]``, ``ds[i]["masks"]``.

    The Deep Lake handle is opened lazily in the process that reads (DataLoader workers included), with
    ``creds`` for a dataset on an object store. ``benchmarks/suites/scaling.py`` measures the same baseline.

    ``augment`` is applied per sample in Python, as a torchvision transform would be, with asyncload's
    own draws (``Augment.draws``, a function of seed, epoch and row): both loaders train on the same
    crops, and the comparison is of loaders, not of augmentations."""

    def __init__(
        self, url: str, start: int, stop: int, creds: dict[str, str] | None = None, *,
        augment: Sequence[Op] = (), seed: int = 0, source: DeepLakeSource | None = None,
        columns: tuple[str, str] = ("images", "masks"),
    ) -> None:  # fmt: skip
        self.url, self.start, self.stop, self.creds = url, start, stop, creds
        self.source, self.columns = source, columns  # source: opened with its creds, token or profile
        self.augment = Augment(augment) if augment else None
        self.seed, self.epoch = seed, 0
        self._ds: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return self.stop - self.start

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose draws ``__getitem__`` applies; DataLoader workers get it with the dataset,
        which they copy when an epoch's iterator starts."""
        self.epoch = epoch

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._pid != os.getpid():
            import deeplake

            ds = (
                self.source.dataset()
                if self.source is not None
                else deeplake.open_read_only(self.url, creds=self.creds)
            )
            self._ds, self._pid = ds, os.getpid()
        index = self.start + i
        row = self._ds[index]
        image, mask = np.array(row[self.columns[0]]), np.array(row[self.columns[1]])
        if mask.ndim == 3:  # a PNG mask reads back as [H, W, 1]
            mask = mask[..., 0]
        if self.augment is None:
            return {"images": torch.from_numpy(image), "masks": torch.from_numpy(mask), "index": index}
        (draw,) = self.augment.draws(self.seed, self.epoch, [index], [image.shape[:2]])
        images, masks = apply_draw(draw, image, mask, self.augment.fills)
        return {"images": images, "masks": masks, "index": index}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ds": None, "_pid": -1}


class Split:
    """One split's batches per epoch through the chosen loader, the same on every rank: equal batch
    counts, and how many of this rank's samples are real (not padding) for exact evaluation."""

    def __init__(
        self, cfg: TrainConfig, url: str, start: int, stop: int, *, train: bool, rank: int, world: int,
        image_dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        self.n, self.rank, self.world = stop - start, rank, world
        self.dataset: Any
        self.sampler: Any = None
        self.augment = augment = split_augment(cfg, train)
        self.columns = (cfg.image_column, cfg.mask_column)
        if cfg.loader == "asyncload":
            source = RangeSource(dataset_source(cfg, url), start, stop)
            how: dict[str, Any] = dict(
                batch_size=cfg.batch_size, shuffle=train, seed=cfg.seed, concurrency=cfg.concurrency,
                prefetch=cfg.prefetch, remainder="pad", augment=augment, decode=cfg.decode,
            )  # fmt: skip
            if cfg.model_ready:  # the step then feeds the images to the model as they come (StepOptions.inputs)
                how.update(normalize=UNet.NORMALIZE, layout="NCHW", dtype=image_dtype)
            if cfg.processes and train:
                # K persistent worker processes, started by the first epoch and kept across epochs; the
                # held-out split is small and read once per epoch by this process's pipeline (its Deep
                # Lake reads in a reader process, as every loader's by default).
                loader = AsyncLoader(source, processes=cfg.processes, rank=rank, world_size=world, **how)
                self.dataset = self.loader = TrainedPrefix(loader)
            else:
                self.dataset = AsyncIterableDataset(source, **how)
                self.loader = torch.utils.data.DataLoader(
                    self.dataset, batch_size=None, num_workers=cfg.num_workers, **worker_start(cfg.num_workers)
                )
            per = EpochSampler(self.n, 1, remainder="pad", shard=Shard(rank, world)).rank_samples
            self.real = max(0, min(per, self.n - rank * per))
        else:
            self.dataset = SyncSegmentation(
                url, start, stop, augment=augment, seed=cfg.seed, source=dataset_source(cfg, url), columns=self.columns
            )
            self.sampler = torch.utils.data.DistributedSampler(
                self.dataset, num_replicas=world, rank=rank, shuffle=train, seed=cfg.seed
            )
            self.loader = torch.utils.data.DataLoader(
                self.dataset,
                batch_size=cfg.batch_size,
                sampler=self.sampler,
                num_workers=cfg.num_workers,
                **worker_start(cfg.num_workers),
            )
            self.real = len(range(rank, self.n, world))  # DistributedSampler pads at the end of each share

    def __len__(self) -> int:
        return len(self.loader)

    def epoch(self, epoch: int) -> Iterator[Any]:
        self.dataset.set_epoch(epoch)
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
        if self.columns == ("images", "masks"):
            return iter(self.loader)
        return _renamed(iter(self.loader), dict(zip(self.columns, ("images", "masks"), strict=True)))

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


def _renamed(it: Iterator[Any], names: dict[str, str]) -> Iterator[Any]:
    """Batches whose image and mask columns carry the step's names (``images``, ``masks``) whatever the
    dataset calls them; closing this generator closes ``it``."""
    try:
        for batch in it:
            yield {names.get(k, k): v for k, v in batch.items()}
    finally:
        close = getattr(it, "close", None)
        if callable(close):
            close()


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
