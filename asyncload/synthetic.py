"""A synthetic segmentation dataset: the embedded default data and the tests' data.

Each image is a colour gradient with 1–4 shaded shapes on it; the mask holds the class of every pixel
(0 background, 1 circle, 2 rectangle, 3 triangle). Each class has its own hue family, jittered per shape,
so a small U-Net learns it in minutes, and PNG/JPEG compress it the way they compress real photos (not
like noise, which would make every read and decode cost unrepresentative).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Literal

import numpy as np

CLASSES = ("background", "circle", "rectangle", "triangle")
_HUES = np.array([[210, 60, 50], [60, 190, 70], [60, 90, 220]], dtype=np.float32)  # circle, rect, triangle


def make_sample(rng: np.random.Generator, height: int = 256, width: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """One ``(image uint8 [H, W, 3], mask uint8 [H, W])`` pair."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    a = rng.uniform(0, 2 * np.pi)
    t = (xx * np.cos(a) + yy * np.sin(a)) / float(height + width) + 0.5
    c0, c1 = rng.uniform(20, 120, 3), rng.uniform(100, 235, 3)
    img = c0[None, None, :] * (1 - t[..., None]) + c1[None, None, :] * t[..., None]
    mask = np.zeros((height, width), np.uint8)
    scale = min(height, width)
    for _ in range(int(rng.integers(1, 5))):
        cls = int(rng.integers(1, 4))
        cy, cx = rng.uniform(0.15, 0.85) * height, rng.uniform(0.15, 0.85) * width
        r = rng.uniform(0.08, 0.22) * scale
        if cls == 1:
            region = (yy - cy) ** 2 + (xx - cx) ** 2 < r**2
        elif cls == 2:
            hy, hx = r * rng.uniform(0.6, 1.0), r * rng.uniform(0.6, 1.0)
            region = (np.abs(yy - cy) < hy) & (np.abs(xx - cx) < hx)
        else:  # triangle: inside three half-planes
            ang = rng.uniform(0, 2 * np.pi) + np.array([0, 2 * np.pi / 3, 4 * np.pi / 3])
            px, py = cx + r * 1.3 * np.cos(ang), cy + r * 1.3 * np.sin(ang)
            region = np.ones((height, width), bool)
            for i in range(3):
                x0, y0, x1, y1 = px[i], py[i], px[(i + 1) % 3], py[(i + 1) % 3]
                region &= (x1 - x0) * (yy - y0) - (y1 - y0) * (xx - x0) >= 0
        colour = np.clip(_HUES[cls - 1] + rng.normal(0, 18, 3), 0, 255)
        shade = 0.75 + 0.25 * np.clip(1 - np.sqrt((yy - cy) ** 2 + (xx - cx) ** 2) / (1.5 * r), 0, 1)
        img[region] = colour[None, :] * shade[region][:, None]
        mask[region] = cls
    return np.clip(img, 0, 255).astype(np.uint8), mask


def make_dataset(
    url: str,
    rows: int = 2000,
    *,
    height: int = 256,
    width: int = 256,
    image_format: Literal["png", "jpg"] = "png",
    seed: int = 0,
    creds: Mapping[str, str] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    chunk: int = 64,
) -> str:
    """Write ``rows`` synthetic samples to a new Deep Lake dataset at ``url`` and return its URL.

    Columns: ``images`` (``Image``, png or jpg, H×W×3 uint8) and ``masks`` (``SegmentMask``, lz4, H×W
    uint8 class ids). Row ``i`` depends only on ``(seed, i)``, so a dataset can be regenerated exactly.
    """
    import deeplake

    from .sources.deeplake import normalize_url

    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if image_format not in ("png", "jpg"):
        raise ValueError(f"image_format must be 'png' or 'jpg', got {image_format!r}")
    url = normalize_url(url)
    cr = dict(creds) if creds else None
    if overwrite and deeplake.exists(url, creds=cr):
        deeplake.delete(url, creds=cr)
    ds = deeplake.create(url, creds=cr)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression=image_format))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="lz4"))
    ds.metadata["classes"] = list(CLASSES)
    ds.metadata["generator"] = f"asyncload.synthetic seed={seed}"
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=rows,
            desc=f"writing {url}",
            unit="row",
            file=sys.stderr,
            disable=not sys.stderr.isatty() and os.environ.get("CI") == "true",
        )
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        pairs = [make_sample(np.random.default_rng([seed, start + i]), height, width) for i in range(n)]
        ds.append({"images": np.stack([p[0] for p in pairs]), "masks": np.stack([p[1] for p in pairs])})
        if bar is not None:
            bar.update(n)
    ds.commit(f"{rows} synthetic segmentation samples")
    if bar is not None:
        bar.close()
    del ds
    return url
