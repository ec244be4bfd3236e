"""Train a small U-Net on synthetic shapes, fed by asyncload: the whole loop on one screen.

    python examples/train_unet.py            # a minute or two on 2 CPU cores; uses CUDA when present

The full job (YAML config, validation, checkpoints, torchrun) is ``python -m asyncload.train``; this
file shows the pieces it is made of: a Deep Lake source, an ``AsyncLoader`` per split, and a
``DeviceFeed`` that puts each batch on the device ahead of the step and measures the wait for data.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F

from asyncload import AsyncLoader, DeepLakeSource, make_dataset
from asyncload.device import DeviceFeed
from asyncload.synthetic import CLASSES
from asyncload.train import RangeSource, UNet

DATA = "data/example-seg-64"
if not os.path.exists(DATA):
    make_dataset(DATA, rows=600, height=64, width=64)  # images uint8 [64, 64, 3], masks uint8 [64, 64]

source = DeepLakeSource(DATA, columns=("images", "masks"))
n_train = int(0.8 * len(source))  # train on rows [0, 480), validate on [480, 600)
train_loader = AsyncLoader(RangeSource(source, 0, n_train), batch_size=32, shuffle=True, seed=0, concurrency=64)
val_loader = AsyncLoader(RangeSource(source, n_train, len(source)), batch_size=64)

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = UNet(classes=len(CLASSES), width=16).to(device)  # takes uint8 [B, H, W, 3] and normalises itself
opt = torch.optim.Adam(model.parameters(), lr=3e-3)

for epoch in range(4):
    train_loader.set_epoch(epoch)  # a new shuffled order each epoch
    model.train()
    feed = DeviceFeed(train_loader, device)  # batches arrive on `device`, copied ahead of the step
    t0, samples = time.perf_counter(), 0
    for batch in feed:
        loss = F.cross_entropy(model(batch["images"]), batch["masks"].long())
        opt.zero_grad()
        loss.backward()
        opt.step()
        samples += len(batch["images"])
    seconds = time.perf_counter() - t0

    model.eval()
    inter = torch.zeros(len(CLASSES))
    union = torch.zeros(len(CLASSES))
    with torch.no_grad():
        for batch in DeviceFeed(val_loader, device):
            pred, mask = model(batch["images"]).argmax(1), batch["masks"]
            for c in range(len(CLASSES)):
                inter[c] += ((pred == c) & (mask == c)).sum().item()
                union[c] += ((pred == c) | (mask == c)).sum().item()
    miou = (inter / union.clamp(min=1)).mean().item()
    print(
        f"epoch {epoch + 1}: last loss {loss.item():.3f}  mIoU {miou:.3f}  {samples / seconds:.0f} samples/s  "
        f"waiting for data {100 * feed.wait_s / seconds:.1f}% of the time"
    )
