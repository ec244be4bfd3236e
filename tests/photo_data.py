"""Photo-like Deep Lake datasets for the decode and augmentation tests: JPEG or PNG images (encoded here,
stored verbatim) of fixed or varied sizes, masks stored as lz4 or PNG.

The pixels are ``asyncload.tools.synthetic``'s shapes with sensor noise, so JPEG q90 and PNG sizes are those of
photos rather than of flat drawings. ``aligned=True`` makes each mask a function of its image's own pixels
(a threshold of a noise-free luminance ramp drawn into both), which is what the geometry tests check
after every augmentation.
"""

from __future__ import annotations

import io
from typing import Literal

import deeplake
import numpy as np
from PIL import Image

from asyncload.tools.synthetic import make_sample


def encode(arr: np.ndarray, fmt: Literal["jpg", "png"], quality: int = 90) -> bytes:
    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(arr).save(buf, format="PNG")
    else:
        Image.fromarray(arr).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def sample(rng: np.random.Generator, h: int, w: int, aligned: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """An ``(image [h, w, 3], mask [h, w])`` pair. ``aligned``: flat halves split by an oblique edge, the
    mask 1 where the image is bright: a mask anyone can recompute from the image's pixels."""
    if aligned:
        yy, xx = np.mgrid[0:h, 0:w]
        a, b = rng.uniform(0.3, 0.7) * w, rng.uniform(-0.5, 0.5)
        bright = xx > a + b * (yy - h / 2)
        img = np.where(bright[..., None], np.uint8(220), np.uint8(30)).astype(np.uint8).repeat(3, axis=2)
        img[..., 1] = np.where(bright, 200, 60)
        return img, bright.astype(np.uint8)
    img, mask = make_sample(rng, h, w)
    noisy = img.astype(np.float32) + rng.normal(0, 2.5, img.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8), mask


def make(
    path: str,
    rows: int,
    *,
    image_format: Literal["jpg", "png"] = "jpg",
    mask_format: Literal["lz4", "png"] = "lz4",
    sizes: tuple[int, int] | None = None,
    aligned: bool = False,
    seed: int = 0,
) -> str:
    """A dataset of ``rows`` pairs at ``path``; ``sizes=(lo, hi)``: each side drawn in that range, else 64×64."""
    url = "file://" + path
    ds = deeplake.create(url)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression=image_format))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression=mask_format))
    images, masks = [], []
    for i in range(rows):
        rng = np.random.default_rng([seed, i])
        h, w = (
            (int(rng.integers(sizes[0], sizes[1] + 1)), int(rng.integers(sizes[0], sizes[1] + 1)))
            if sizes
            else (64, 64)
        )
        img, mask = sample(rng, h, w, aligned)
        images.append(encode(img, image_format))
        masks.append(encode(mask, "png") if mask_format == "png" else mask)
    ds.append({"images": images, "masks": masks if mask_format == "png" else masks})
    ds.commit()
    del ds
    return url


def make_odd_masks(url: str, rows: int, odd: tuple[int, ...], seed: int) -> str:
    """``rows`` 64×64 JPEG images with lz4 masks, the masks of rows ``odd`` 32×48: not their image's size,
    so they cannot be paired with it and are read again store-decoded."""
    ds = deeplake.create(url)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="lz4"))
    pairs = [sample(np.random.default_rng([seed, i]), 64, 64) for i in range(rows)]
    ds.append({
        "images": [encode(img, "jpg") for img, _ in pairs],
        "masks": [np.ascontiguousarray(m[:32, :48]) if i in odd else m for i, (_, m) in enumerate(pairs)],
    })  # fmt: skip
    ds.commit()
    return url
