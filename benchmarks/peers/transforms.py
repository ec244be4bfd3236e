"""The per-sample augmentation as users write it today, in Pillow and NumPy, for the Python-transform rows.

``RandomResizedCropFlip`` is the same geometry as ``asyncload``'s ``RandomResizedCrop(256, scale=(0.25,
1), ratio=(3/4, 4/3))`` + ``RandomHorizontalFlip(0.5)`` (torchvision's way of drawing the box: up to 10
tries at a random area and log-uniform aspect, else the centre crop), applied alike to the image
(bilinear) and its mask (nearest). It takes a decoded sample and returns 256×256 arrays, so it runs as
``AsyncLoader(transform=...)`` (on ``{column: array, "index": i}``) and in a map-style Dataset's
``__getitem__``. A class, not a closure, so that spawn-started DataLoader workers can pickle it.
"""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
from PIL import Image


class RandomResizedCropFlip:
    def __init__(self, size: int = 256, scale: tuple[float, float] = (0.25, 1.0), ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: float = 0.5) -> None:  # fmt: skip
        self.size, self.scale, self.ratio, self.flip = size, scale, ratio, flip

    def box(self, h: int, w: int) -> tuple[int, int, int, int]:
        """(top, left, height, width) of the crop, as torchvision's ``RandomResizedCrop.get_params``."""
        area = h * w
        for _ in range(10):
            target = area * random.uniform(*self.scale)
            aspect = math.exp(random.uniform(math.log(self.ratio[0]), math.log(self.ratio[1])))
            cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < cw <= w and 0 < ch <= h:
                return random.randint(0, h - ch), random.randint(0, w - cw), ch, cw
        ch, cw = h, w
        if w / h < self.ratio[0]:
            ch = round(w / self.ratio[0])
        elif w / h > self.ratio[1]:
            cw = round(h * self.ratio[1])
        return (h - ch) // 2, (w - cw) // 2, ch, cw

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        image = Image.fromarray(np.asarray(sample["images"]))
        mask = Image.fromarray(np.asarray(sample["masks"]).reshape(image.height, image.width))
        top, left, ch, cw = self.box(image.height, image.width)
        crop = (left, top, left + cw, top + ch)
        out = (self.size, self.size)
        image = image.resize(out, Image.BILINEAR, box=crop)
        mask = mask.resize(out, Image.NEAREST, box=crop)
        if random.random() < self.flip:
            image, mask = image.transpose(Image.FLIP_LEFT_RIGHT), mask.transpose(Image.FLIP_LEFT_RIGHT)
        result = {"images": np.array(image), "masks": np.array(mask)}
        if "index" in sample:
            result["index"] = sample["index"]
        return result


def named(name: str) -> Any:
    """The transform a spec names."""
    if name == "pillow_rrc_flip":
        return RandomResizedCropFlip()
    raise ValueError(f"unknown transform {name!r}")
