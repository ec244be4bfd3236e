"""A compact U-Net: the model the training job and the GPU benchmarks train."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..synthetic import CLASSES


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

    #: ``prepare`` as a loader's ``normalize=(mean, std)`` on pixels scaled to 0..1: (x/255 - 0.5) / (64/255)
    #: is (x - 127.5) / 64 (equal up to float rounding).
    NORMALIZE = ((0.5, 0.5, 0.5), (64 / 255, 64 / 255, 64 / 255))

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
