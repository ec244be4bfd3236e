"""One training step, and the step loop that times what the host waits for: the loader's next batch (data
wait) apart from the device (device sync)."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .model import UNet


def iou_counts(logits: torch.Tensor, masks: torch.Tensor, keep: int, classes: int | None = None) -> torch.Tensor:
    """Per class ``[intersection..., union...]`` pixel counts over the first ``keep`` samples, for
    ``classes`` classes (default: the logits' channels)."""
    pred, masks = logits[:keep].argmax(1), masks[:keep].long()
    k = classes if classes is not None else logits.shape[1]
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
        """uint8 ``[B, H, W, 3]`` on the device → normalised float ``[B, 3, H, W]`` in the memory format.

        Model-ready batches (the loader's ``normalize``, ``layout``, ``dtype``) are not converted again:
        NCHW goes in as it is (one copy only if ``channels_last`` asks for another memory format), and a
        normalized NHWC batch is permuted as a view, which *is* channels_last memory."""
        if images.dtype == torch.uint8:
            return UNet.prepare(images).contiguous(memory_format=self.memory_format)
        if images.ndim == 4 and images.shape[1] != 3 and images.shape[-1] == 3:  # normalized NHWC
            images = images.permute(0, 3, 1, 2)
        return images.contiguous(memory_format=self.memory_format)

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
