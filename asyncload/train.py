"""Train a compact U-Net on the synthetic segmentation data, fed by asyncload or by the synchronous baseline.

    python -m asyncload.train --config configs/train_unet.yaml [--set key=value ...]
    torchrun --nproc_per_node=2 -m asyncload.train --config configs/train_unet.yaml

What it is for: the end-to-end check that the loader feeds a real training loop, and the figure that
matters to a user, the fraction of step time spent waiting for data, measured the same way for
``loader: asyncload`` and for ``loader: sync`` (a map-style ``Dataset`` reading ``ds[i]["images"]``,
``ds[i]["masks"]`` through ``DataLoader``).

Choices, and why:
- **Validation split by index range**: train on rows ``[0, n_train)``, evaluate on ``[n_train, n)``. The
  loader has no subset option, so ``RangeSource`` (a thin ``Source`` over a row range of another source)
  gives each split its own, exact epoch; the sampler then shards only that range across ranks and
  workers. No second dataset is written and nothing is filtered after reading.
- **Scale-out** follows torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``): a process group (gloo on CPU, nccl on CUDA) and
  ``DistributedDataParallel``. ``AsyncIterableDataset`` reads the rank from the process group, and every
  rank gets the same number of batches, which is what keeps DDP's all-reduces in step. Only rank 0 logs
  and writes checkpoints; losses, IoU counts and timings are all-reduced.
- **Evaluation counts each held-out row once**: ranks pad their shares to equal length, so the padded
  repeats at the end of a rank's share are masked out of the IoU counts.
- **Checkpoints** hold model, optimizer, epoch, global step and the step within the epoch (plus the
  loader's ``state_dict()`` when it offers one). They are written atomically (temp file + rename) so an
  interrupted save never leaves a broken file. A mid-epoch resume restores the loader state when the
  loader can take it back; otherwise it replays the epoch's deterministic order and skips the batches
  already trained (read, not trained).
- **GPU practice, on by default on CUDA**: bf16 autocast (no loss scaling needed, unlike fp16),
  channels_last tensors (the layout cuDNN's fastest convolution kernels use on tensor cores) and
  ``cudnn.benchmark`` (the U-Net's shapes are fixed, so the one-off kernel search pays). On the issue-12
  H100 the model alone ran 1,276 samples/s in fp32 and 1,848 with bf16 + channels_last. Each has an
  off switch in the config; on the CPU they are left off (bf16 convolutions are slow on most CPUs).
- **A truthful data-wait figure**: only the time the loop is blocked in ``next()`` for its next batch
  counts as waiting for data. The device runs asynchronously, so the host also waits for it, at known
  points only (the loss read back every ``SYNC_EVERY`` steps and at the end of the epoch), and that time
  is reported apart as "device sync". The old figure (time inside ``DeviceFeed``, which then copied on
  this thread) put the host's wait for the GPU under data wait: 50-56% on the H100 where the model was
  the bottleneck.
- **The model-only rate, measured the same way**: after training, the same step function runs
  ``model_only_steps`` times on one batch already on the device (model and optimizer put back after),
  so "trains at X% of the model-only rate" compares like with like.
"""

from __future__ import annotations

import argparse
import copy
import inspect
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import islice, repeat
from typing import Any, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .config import check, load_config, parse_overrides, setting, validate
from .dataset import AsyncIterableDataset
from .device import DeviceFeed
from .errors import ConfigError
from .sampler import EpochSampler, Shard
from .sources.base import Columns, Source
from .sources.deeplake import DeepLakeSource, normalize_url
from .synthetic import CLASSES

__all__ = ["RangeSource", "StepOptions", "TrainConfig", "UNet", "main", "model_only_rate", "train", "train_step"]


def _device_ok(v: str) -> bool:
    return v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; ``configs/train_unet.yaml`` holds the defaults below."""

    data: str = setting("data/synthetic-seg-64", "a non-empty path or URL of a Deep Lake dataset", lambda v: bool(v))
    make_data: bool = True  # write the synthetic dataset at ``data`` when nothing is there
    rows: int = setting(1200, "an int >= 0 (rows used, and made when missing; 0: all rows)", lambda v: v >= 0)
    image_size: int = setting(64, "an int >= 8 (height and width of made images)", lambda v: v >= 8)
    batch_size: int = setting(32, "an int >= 1", lambda v: v >= 1)
    epochs: int = setting(4, "an int >= 1", lambda v: v >= 1)
    lr: float = setting(3e-3, "a number > 0", lambda v: v > 0)
    width: int = setting(16, "an int >= 1 (channels of the first U-Net level; then 2x and 4x)", lambda v: v >= 1)
    loader: Literal["asyncload", "sync"] = "asyncload"
    concurrency: int = setting(64, "an int >= 1", lambda v: v >= 1)
    prefetch: int = setting(4, "an int >= 1", lambda v: v >= 1)
    num_workers: int = setting(0, "an int >= 0 (DataLoader worker processes)", lambda v: v >= 0)
    depth: int = setting(2, "an int >= 0 (batches copied to the device ahead)", lambda v: v >= 0)
    bf16: bool = True  # bf16 autocast on CUDA (ignored on the CPU)
    channels_last: bool = True  # channels_last activations and weights on CUDA (ignored on the CPU)
    cudnn_benchmark: bool = True  # let cuDNN pick the fastest kernels for the (fixed) shapes, on CUDA
    model_only_steps: int = setting(
        20, "an int >= 0 (timed steps on one batch already on the device after training; 0: skip)", lambda v: v >= 0
    )
    holdout: float = setting(
        0.2, "a number > 0 and < 1 (fraction of rows held out for validation)", lambda v: 0 < v < 1
    )
    seed: int = 0
    device: str = setting("auto", "'auto', 'cpu', 'cuda' or 'cuda:N'", _device_ok)
    threads: int = setting(0, "an int >= 0 (torch CPU threads; 0: torch's default)", lambda v: v >= 0)
    checkpoint: str | None = "checkpoints/unet.pt"
    resume: bool = True  # continue from ``checkpoint`` when it exists
    checkpoint_every: int = setting(
        0, "an int >= 0 (steps between mid-epoch checkpoints; 0: epoch ends only)", lambda v: v >= 0
    )
    max_steps_per_epoch: int = setting(0, "an int >= 0 (0: whole epochs)", lambda v: v >= 0)
    index_log: str | None = None  # a folder: each rank appends the dataset indices it trained on per epoch
    progress: bool = True  # tqdm bar on rank 0

    def __post_init__(self) -> None:
        validate(self)


# -- data ------------------------------------------------------------------------------------------


class RangeSource(Source[Any]):
    """Rows ``[start, stop)`` of another source, renumbered from 0: one split of a dataset.

    Reads go straight to ``inner`` with the offset added, so errors name the real dataset and its real
    row numbers. Picklable like every source (``inner`` travels as its description)."""

    def __init__(self, inner: Source[Any], start: int, stop: int) -> None:
        super().__init__(inner.url, inner.columns)
        if not 0 <= start <= stop <= len(inner):
            raise ValueError(f"RangeSource: [{start}, {stop}) is not within the {len(inner)} rows of {inner.url}")
        self.inner, self.start, self.stop = inner, start, stop

    def _open(self) -> Any:
        return self.inner.handle()

    def _length(self, handle: Any) -> int:
        return self.stop - self.start

    @property
    def preferred_read_mode(self) -> Literal["row", "column"]:
        return self.inner.preferred_read_mode

    # The loader's hooks go to the store that does the work.
    def configure(self, requests_in_flight: int, samples_in_flight: int | None = None) -> None:
        self.inner.configure(requests_in_flight, samples_in_flight)

    def throttle_count(self) -> int:
        return self.inner.throttle_count()

    def retry_count(self) -> int:
        return self.inner.retry_count()

    async def read(self, indices: list[int]) -> Columns:
        return await self.inner.read([self.start + i for i in indices])

    def __repr__(self) -> str:
        return f"RangeSource({self.inner!r}, {self.start}, {self.stop})"


class SyncSegmentation(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """The baseline: rows ``[start, stop)`` read one by one with ``ds[i]["images"]``, ``ds[i]["masks"]``.

    The Deep Lake handle is opened lazily in the process that reads (DataLoader workers included)."""

    def __init__(self, url: str, start: int, stop: int) -> None:
        self.url, self.start, self.stop = url, start, stop
        self._ds: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._pid != os.getpid():
            import deeplake

            self._ds, self._pid = deeplake.open_read_only(self.url), os.getpid()
        row = self._ds[self.start + i]
        return {
            "images": torch.from_numpy(np.array(row["images"])),
            "masks": torch.from_numpy(np.array(row["masks"])),
            "index": self.start + i,
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ds": None, "_pid": -1}


class _Split:
    """One split's batches per epoch through the chosen loader, the same on every rank: equal batch
    counts, and how many of this rank's samples are real (not padding) for exact evaluation."""

    def __init__(
        self, cfg: TrainConfig, url: str, start: int, stop: int, *, train: bool, rank: int, world: int
    ) -> None:
        self.n, self.rank, self.world = stop - start, rank, world
        self.dataset: Any
        if cfg.loader == "asyncload":
            self.dataset = AsyncIterableDataset(
                RangeSource(DeepLakeSource(url), start, stop), cfg.batch_size, shuffle=train, seed=cfg.seed,
                concurrency=cfg.concurrency, prefetch=cfg.prefetch, remainder="pad",
            )  # fmt: skip
            self.sampler: Any = None
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


def _limit(it: Iterator[Any], n: int) -> Iterator[Any]:
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


# -- model -----------------------------------------------------------------------------------------


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
    )  # fmt: skip


class UNet(nn.Module):
    """A compact U-Net: three levels (``width``, 2x, 4x channels), skip connections, ``classes`` logits.

    It takes the loader's batch as it comes, uint8 ``[B, H, W, 3]``, and normalises on the device: the
    copy to the device moves 1 byte per channel instead of 4, and inference needs no separate
    preprocessing. Sides that are not multiples of 4 are padded for the two poolings and cropped back."""

    def __init__(self, classes: int = len(CLASSES), width: int = 16) -> None:
        super().__init__()
        w = width
        self.enc1, self.enc2, self.mid = _block(3, w), _block(w, 2 * w), _block(2 * w, 4 * w)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2), _block(4 * w, 2 * w)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * w, w, 2, stride=2), _block(2 * w, w)
        self.head = nn.Conv2d(w, classes, 1)

    @staticmethod
    def prepare(images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, H, W, 3]`` → float ``[B, 3, H, W]``, roughly zero-mean, unit-variance."""
        return (images.permute(0, 3, 1, 2).float() - 127.5) / 64.0

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.prepare(images) if images.dtype == torch.uint8 else images
        h, w = x.shape[-2:]
        ph, pw = -h % 4, -w % 4
        if ph or pw:
            x = F.pad(x, (0, pw, 0, ph))
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))
        return self.head(d1)[..., :h, :w]


# -- the run ---------------------------------------------------------------------------------------


@dataclass
class _World:
    rank: int
    world: int
    device: torch.device
    owns_group: bool

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so counts stay exact)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        if self.world > 1:
            t = t.to(self.device) if dist.get_backend() == "nccl" else t
            dist.all_reduce(t)
        return t.cpu().tolist()


def _world(cfg: TrainConfig) -> _World:
    """Join torchrun's process group when its variables are set (gloo on CPU, nccl on CUDA)."""
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    check(
        "device", cfg.device, want == "cpu" or torch.cuda.is_available(), "'cpu' or 'auto' here: CUDA is not available"
    )
    device = torch.device(want)
    if device.type == "cuda" and device.index is not None:
        gpus = torch.cuda.device_count()
        check("device", cfg.device, device.index < gpus, f"this machine has {gpus} CUDA device(s)")
    if device.type == "cuda" and device.index is None:
        grouped = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if grouped else int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0)) if world > 1 else torch.cuda.current_device()
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if world > 1 else 1
        # Checked before joining the group, on every rank alike: all of them fail with this message
        # instead of one dying in CUDA ("invalid device ordinal") while the others wait for it.
        device = torch.device("cuda", cuda_index_for_rank(cfg.device, local, ranks_here, torch.cuda.device_count()))
    owns = False
    if not (dist.is_available() and dist.is_initialized()) and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # env://: MASTER_ADDR/PORT, RANK...
        owns = True
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return _World(rank, world, device, owns)


def cuda_index_for_rank(setting_: str, local_rank: int, ranks_here: int, gpus: int) -> int:
    """The GPU of a rank (its local rank), or a ``ConfigError`` naming both counts when this machine
    runs more ranks than it has GPUs (``device: cpu`` runs any number)."""
    check(
        "device", setting_, ranks_here <= gpus and 0 <= local_rank < gpus,
        f"{ranks_here} rank(s) run on this machine but it has {gpus} CUDA device(s); "
        f"start at most {gpus} per machine (torchrun --nproc_per_node={gpus}) or set device: cpu",
    )  # fmt: skip
    return local_rank


def _ensure_data(cfg: TrainConfig, w: _World) -> str:
    """The dataset URL; rank 0 writes the synthetic dataset first when it is missing and allowed to."""
    import deeplake

    from .synthetic import make_dataset

    url = normalize_url(cfg.data)
    if w.main and cfg.make_data and not deeplake.exists(url):
        print(f"making {cfg.rows or 1200} synthetic rows of {cfg.image_size}x{cfg.image_size} at {url}", flush=True)
        make_dataset(
            url, cfg.rows or 1200, height=cfg.image_size, width=cfg.image_size, seed=cfg.seed, progress=cfg.progress
        )
    w.barrier()
    return url


def _save(path: str, state: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _loader_state(loader: Any, consumed: int) -> dict[str, Any] | None:
    """The loader's resume point after ``consumed`` batches of the current epoch, when it offers one.

    ``AsyncIterableDataset.state_dict(batches_consumed)`` is told the count (only the training loop
    knows what DataLoader handed out); a loader that tracks it itself takes no argument."""
    fn = getattr(loader, "state_dict", None)
    if fn is None:
        return None
    if "batches_consumed" in inspect.signature(fn).parameters:
        return dict(fn(batches_consumed=consumed))
    return dict(fn())


def _iou_counts(logits: torch.Tensor, masks: torch.Tensor, keep: int) -> torch.Tensor:
    """Per class ``[intersection..., union...]`` pixel counts over the first ``keep`` samples."""
    pred, masks = logits[:keep].argmax(1), masks[:keep].long()
    k = len(CLASSES)
    inter = torch.stack([((pred == c) & (masks == c)).sum() for c in range(k)])
    union = torch.stack([((pred == c) | (masks == c)).sum() for c in range(k)])
    return torch.cat([inter, union]).double()


SYNC_EVERY = 10  # steps between reading the loss back (the loop's one regular device synchronisation)


@dataclass(frozen=True)
class StepOptions:
    """How a step runs on its device: bf16 autocast and the memory format of activations and weights.

    Built by ``for_device`` from the config's switches, which only take effect on CUDA."""

    device: torch.device
    bf16: bool = False
    channels_last: bool = False

    @classmethod
    def for_device(cls, device: torch.device, bf16: bool, channels_last: bool, cudnn_benchmark: bool) -> StepOptions:
        cuda = device.type == "cuda"
        if cuda and cudnn_benchmark:
            torch.backends.cudnn.benchmark = True  # shapes are fixed: the one-off kernel search pays
        return cls(device, bf16 and cuda, channels_last and cuda)

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last if self.channels_last else torch.contiguous_format

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 ``[B, H, W, 3]`` on the device → normalised float ``[B, 3, H, W]`` in the memory format."""
        return UNet.prepare(images).contiguous(memory_format=self.memory_format)

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, images: torch.Tensor, masks: torch.Tensor, how: StepOptions
) -> torch.Tensor:
    """One optimizer step on a batch already on the device; returns the loss (not synchronised)."""
    with how.autocast():
        loss = F.cross_entropy(model(how.inputs(images)), masks.long())  # autocast runs the loss in fp32
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.detach()


def sync(device: torch.device) -> float:
    """Wait for the device's queued work; returns the seconds waited (0 on the CPU, which never queues)."""
    if device.type != "cuda":
        return 0.0
    t0 = time.perf_counter()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


@dataclass
class StepTimes:
    """Where a run of steps spent its wall time: waiting for data (blocked in ``next()``) and waiting for
    the device (``sync``); the rest is the host running the steps (and blocking in kernel launches)."""

    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


def timed_steps(
    batches: Iterator[Any],
    step: Callable[[Any], torch.Tensor],
    device: torch.device,
    after: Callable[[Any, torch.Tensor, StepTimes], None] | None = None,
) -> StepTimes:
    """Run ``step(batch)`` for every batch; the training loop of the job, the example and the benchmark.

    Only ``next(batches)`` counts as data wait. The loss is read back every ``SYNC_EVERY`` steps (which
    bounds how far the host runs ahead of the device) and the device is synchronised at the end; both
    count as device sync. ``after(batch, loss, times)`` runs after each step (logging, checkpoints)."""
    times = StepTimes()
    t0 = time.perf_counter()
    while True:
        t = time.perf_counter()
        batch = next(batches, None)
        times.wait_s += time.perf_counter() - t
        if batch is None:
            break
        loss = step(batch)
        times.steps += 1
        times.samples += len(batch["images"])
        if times.steps % SYNC_EVERY == 0:
            t = time.perf_counter()
            loss.item()
            times.sync_s += time.perf_counter() - t
        if after is not None:
            after(batch, loss, times)
    times.sync_s += sync(device)
    times.wall_s = time.perf_counter() - t0
    return times


def model_only_rate(
    model: nn.Module, opt: torch.optim.Optimizer, batch: dict[str, torch.Tensor], how: StepOptions, steps: int
) -> float:
    """Samples/s of ``train_step`` alone, fed one batch already on the device: the ceiling a loader is
    judged against. The same loop as training (``timed_steps``) after a few warm-up steps; the weights
    and the optimizer state are put back afterwards, so training is unchanged. Under DDP every rank
    must call it (the steps all-reduce)."""
    net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    saved = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())

    def step(b: dict[str, torch.Tensor]) -> torch.Tensor:
        return train_step(model, opt, b["images"], b["masks"], how)

    timed_steps(repeat(batch, max(3, steps // 4)), step, how.device)  # warm-up: cuDNN's search, allocator
    rate = timed_steps(repeat(batch, steps), step, how.device).samples_per_s
    net.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    return rate


def train(cfg: TrainConfig, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run the training job of ``cfg``; returns one dict of figures per epoch run (the same on all ranks).

    ``on_step`` (optional) is called after every optimizer step with ``{"epoch", "step", "loss",
    "indices"}``; an exception raised there stops the run like a crash would (checkpoints stay)."""
    w = _world(cfg)
    threads = torch.get_num_threads()
    benchmark = torch.backends.cudnn.benchmark
    try:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)  # process-wide: put back below for in-process callers
        return _run(cfg, w, on_step)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
        if w.owns_group:
            dist.destroy_process_group()


def _run(cfg: TrainConfig, w: _World, on_step: Callable[[dict[str, Any]], None] | None) -> list[dict[str, Any]]:
    from tqdm import tqdm

    url = _ensure_data(cfg, w)
    total = len(DeepLakeSource(url))
    n = min(cfg.rows, total) if cfg.rows else total
    n_train = int(n * (1 - cfg.holdout))
    check(
        "holdout", cfg.holdout, 0 < n_train < n, f"a fraction that leaves rows on both sides of the split of {n} rows"
    )
    train_split = _Split(cfg, url, 0, n_train, train=True, rank=w.rank, world=w.world)
    val_split = _Split(cfg, url, n_train, n, train=False, rank=w.rank, world=w.world)
    steps = len(train_split) if not cfg.max_steps_per_epoch else min(cfg.max_steps_per_epoch, len(train_split))

    how = StepOptions.for_device(w.device, cfg.bf16, cfg.channels_last, cfg.cudnn_benchmark)
    torch.manual_seed(cfg.seed)
    net = UNet(len(CLASSES), cfg.width).to(w.device, memory_format=how.memory_format)
    model: nn.Module = net
    if w.world > 1:
        model = nn.parallel.DistributedDataParallel(
            net, device_ids=[w.device.index] if w.device.type == "cuda" else None
        )
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)

    epoch, step, skip = 0, 0, 0
    loader_state_restored = False
    if cfg.checkpoint and cfg.resume and os.path.exists(cfg.checkpoint):
        ck = torch.load(cfg.checkpoint, map_location=w.device, weights_only=True)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        epoch, step, skip = int(ck["epoch"]), int(ck["step"]), int(ck["step_in_epoch"])
        if ck.get("loader") is not None and hasattr(train_split.dataset, "load_state_dict"):
            train_split.dataset.load_state_dict(ck["loader"])
            loader_state_restored = True
        if w.main:
            print(
                f"resumed from {cfg.checkpoint}: epoch {epoch + 1}, step {step} ({skip} steps into the epoch)",
                flush=True,
            )

    def save(epoch_: int, in_epoch: int) -> None:
        if w.main and cfg.checkpoint:
            loader_state = _loader_state(train_split.dataset, in_epoch) if in_epoch else None
            _save(cfg.checkpoint, {
                "model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch_, "step": step,
                "step_in_epoch": in_epoch, "loader": loader_state, "config": asdict(cfg),
            })  # fmt: skip
        w.barrier()  # nobody runs ahead of a checkpoint that may be needed to restart them

    if w.main:
        print(
            f"training a U-Net (width {cfg.width}) on {n_train} rows, validating on {n - n_train}, of {url}; "
            f"loader {cfg.loader}, {w.world} rank(s) on {w.device}, {steps} steps/epoch of {cfg.batch_size} per rank; "
            f"bf16 {how.bf16}, channels_last {how.channels_last}",
            flush=True,
        )
    history: list[dict[str, Any]] = []
    first_epoch = epoch
    kept: dict[str, torch.Tensor] | None = None  # a full batch on the device, for the model-only rate
    for epoch in range(first_epoch, cfg.epochs):
        start = skip if epoch == first_epoch else 0  # only a resumed epoch begins part-way
        model.train()
        raw = train_split.epoch(epoch)
        if start and not loader_state_restored:
            deque(islice(raw, start), maxlen=0)  # the order is deterministic: skip what was trained already
        feed = DeviceFeed(_limit(raw, steps - start), w.device, depth=cfg.depth)
        bar = tqdm(total=steps, initial=start, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="step",
                   disable=not (w.main and cfg.progress), leave=False)  # fmt: skip
        loss_sum = torch.zeros((), dtype=torch.float64, device=w.device)
        seen: list[int] = []

        def one_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            nonlocal kept
            if kept is None or len(batch["images"]) > len(kept["images"]):
                kept = batch
            return train_step(model, opt, batch["images"], batch["masks"], how)

        def after(  # this epoch's state bound as defaults: the function is made anew each epoch
            batch: dict[str, torch.Tensor], loss: torch.Tensor, times: StepTimes,
            epoch: int = epoch, start: int = start, loss_sum: torch.Tensor = loss_sum, seen: list[int] = seen,
            bar: Any = bar,
        ) -> None:  # fmt: skip
            nonlocal step
            step += 1
            in_epoch = start + times.steps
            loss_sum.add_(loss.double() * len(batch["images"]))
            if times.steps % SYNC_EVERY == 0 and not bar.disable:
                bar.set_postfix(loss=f"{loss.item():.3f}")  # already read back this step: costs nothing
            # Reading indices back to the host waits for the device: only when asked for.
            idx = batch["index"].tolist() if (cfg.index_log or on_step is not None) else []
            seen.extend(idx)
            bar.update(1)
            if on_step is not None:
                on_step({"epoch": epoch, "step": step, "loss": float(loss), "indices": idx})
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and in_epoch < steps:
                save(epoch, in_epoch)

        times = timed_steps(feed, one_step, w.device, after)
        bar.close()
        feed.close()
        if cfg.index_log:
            os.makedirs(cfg.index_log, exist_ok=True)
            with open(os.path.join(cfg.index_log, f"rank{w.rank}.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps({"epoch": epoch, "rank": w.rank, "world_size": w.world, "indices": seen}) + "\n")

        ious, ev_s = _evaluate(net, val_split, w, how)
        loss_total, n_samples, wait_total, sync_total, wall_total = w.sum(
            [float(loss_sum), times.samples, times.wait_s, times.sync_s, times.wall_s]
        )
        present = [i for i in ious if not math.isnan(i)]
        row: dict[str, Any] = {
            "epoch": epoch,
            "step": step,
            "steps": steps - start,
            "loss": loss_total / max(n_samples, 1),
            "miou": sum(present) / len(present) if present else float("nan"),
            "iou": dict(zip(CLASSES, ious, strict=True)),
            "samples": int(n_samples),
            "samples_per_s": n_samples / (wall_total / w.world) if wall_total else 0.0,
            "data_wait": wait_total / wall_total if wall_total else 0.0,
            "device_sync": sync_total / wall_total if wall_total else 0.0,
            "train_s": wall_total / w.world,
            "eval_s": ev_s,
        }
        history.append(row)
        if w.main:
            print(
                f"epoch {epoch + 1}/{cfg.epochs}  step {step}  loss {row['loss']:.4f}  mIoU {row['miou']:.3f}  "
                f"{row['samples_per_s']:,.0f} samples/s  data wait {100 * row['data_wait']:.1f}%, "
                f"device sync {100 * row['device_sync']:.1f}% of step time  "
                f"({row['train_s']:.1f} s train, {ev_s:.1f} s eval)",
                flush=True,
            )
        save(epoch + 1, 0)
    if w.main and not history:
        print(f"nothing to do: the checkpoint {cfg.checkpoint} is already at epoch {epoch} of {cfg.epochs}", flush=True)
    if history and kept is not None and cfg.model_only_steps:
        (rate,) = w.sum([model_only_rate(model, opt, kept, how, cfg.model_only_steps)])
        last = history[-1]
        last["model_only_samples_per_s"] = rate  # summed over ranks, like samples_per_s
        last["of_model_only"] = last["samples_per_s"] / rate if rate else 0.0
        if w.main:
            print(
                f"model alone (one batch already on {w.device}, same step loop): {rate:,.0f} samples/s; "
                f"training ran at {100 * last['of_model_only']:.0f}% of it in its last epoch",
                flush=True,
            )
    return history


@torch.no_grad()
def _evaluate(net: nn.Module, split: _Split, w: _World, how: StepOptions) -> tuple[list[float], float]:
    """Per-class IoU over the held-out split, each row counted once across ranks; and the seconds taken."""
    t0 = time.perf_counter()
    net.eval()
    counts = torch.zeros(2 * len(CLASSES), dtype=torch.float64, device=w.device)
    left = split.real
    with DeviceFeed(split.epoch(0), w.device) as feed:
        for batch in feed:
            keep = min(left, len(batch["images"]))
            left -= keep
            if keep:
                with how.autocast():
                    logits = net(how.inputs(batch["images"]))
                counts += _iou_counts(logits, batch["masks"], keep)
    net.train()
    total = w.sum(counts.cpu().tolist())
    k = len(CLASSES)
    ious = [total[c] / total[k + c] if total[k + c] else float("nan") for c in range(k)]
    return ious, time.perf_counter() - t0


# -- entry points ----------------------------------------------------------------------------------


def config_from_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """``--config FILE`` (optional: the dataclass defaults otherwise) and ``--set key=value`` overrides."""
    p = argparse.ArgumentParser(
        prog="asyncload train", description="Train a compact U-Net on the synthetic segmentation data."
    )
    p.add_argument("--config", help="YAML file of TrainConfig keys (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set loader=sync (repeatable)")  # fmt: skip
    args = p.parse_args(argv)
    return load_config(args.config, TrainConfig, parse_overrides(args.overrides))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse, train, and turn a configuration mistake into one line and exit code 2."""
    try:
        cfg = config_from_args(argv)
        train(cfg)
    except ConfigError as exc:
        print(f"asyncload train: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
