"""Train a small U-Net on synthetic shapes, fed by asyncload: the whole loop on one screen.

    python examples/train_unet.py            # a minute or two on 2 CPU cores; uses CUDA when present

The full job (YAML config, validation, checkpoints, torchrun) is ``python -m asyncload.train``; this
file shows the pieces it is made of and the habits that keep a GPU busy:

- ``DeviceFeed`` puts each batch on the device ahead of the step: a pin thread copies it into pinned
  memory and issues the copy on a side stream, so the training thread never copies.
- On CUDA: bf16 autocast, channels_last and ``cudnn.benchmark`` (``StepOptions``); the CPU runs fp32.
- The report is honest about where time goes: "data wait" is only the time spent in ``next()`` for the
  next batch; the time the host waits for the GPU (reading the loss back) is "device sync"; and the
  model-only rate (the same step on a batch already on the device) is the ceiling to compare with.
"""

from __future__ import annotations

import os

import torch

from asyncload import AsyncLoader, DeepLakeSource, make_dataset
from asyncload.device import DeviceFeed
from asyncload.tools.synthetic import CLASSES
from asyncload.tools.train import RangeSource, StepOptions, UNet, model_only_rate, timed_steps, train_step

DATA = "data/example-seg-64"
if not os.path.exists(DATA):
    make_dataset(DATA, rows=600, height=64, width=64)  # images uint8 [64, 64, 3], masks uint8 [64, 64]

source = DeepLakeSource(DATA, columns=("images", "masks"))
n_train = int(0.8 * len(source))  # train on rows [0, 480), validate on [480, 600)
train_loader = AsyncLoader(RangeSource(source, 0, n_train), batch_size=32, shuffle=True, seed=0, concurrency=64)
val_loader = AsyncLoader(RangeSource(source, n_train, len(source)), batch_size=64)

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
how = StepOptions.for_device(device, bf16=True, channels_last=True, cudnn_benchmark=True)  # no-ops on the CPU
torch.manual_seed(0)
model = UNet(classes=len(CLASSES), width=16).to(device, memory_format=how.memory_format)
opt = torch.optim.Adam(model.parameters(), lr=3e-3)

for epoch in range(4):
    train_loader.set_epoch(epoch)  # a new shuffled order each epoch
    model.train()
    with DeviceFeed(train_loader, device) as feed:  # batches arrive on `device`, copied ahead of the step
        # next(feed) is timed as data wait; reading the loss back (every 10 steps) as device sync
        times = timed_steps(feed, lambda b: train_step(model, opt, b["images"], b["masks"], how), device)

    model.eval()
    inter = torch.zeros(len(CLASSES))
    union = torch.zeros(len(CLASSES))
    with torch.no_grad(), DeviceFeed(val_loader, device) as val:
        for batch in val:
            with how.autocast():
                pred = model(how.inputs(batch["images"])).argmax(1)
            for c in range(len(CLASSES)):
                inter[c] += ((pred == c) & (batch["masks"] == c)).sum().item()
                union[c] += ((pred == c) | (batch["masks"] == c)).sum().item()
    miou = (inter / union.clamp(min=1)).mean().item()
    print(
        f"epoch {epoch + 1}: mIoU {miou:.3f}  {times.samples_per_s:,.0f} samples/s  "
        f"data wait {100 * times.wait_s / times.wall_s:.1f}%  device sync {100 * times.sync_s / times.wall_s:.1f}%"
    )

# The ceiling: the same step on one batch already on the device (weights and optimizer put back after).
train_loader.set_epoch(0)
with DeviceFeed(train_loader, device) as feed:
    one = next(feed)
rate = model_only_rate(model, opt, one, how, steps=20)
print(f"model alone: {rate:,.0f} samples/s; training ran at {100 * times.samples_per_s / rate:.0f}% of it")
