"""A synthetic segmentation dataset: the embedded default data, the tests' data and the photo-like demo data.

Each image is a colour gradient with 1–4 shaded shapes on it; the mask holds the class of every pixel
(0 background, 1 circle, 2 rectangle, 3 triangle). Each class has its own hue family, jittered per shape,
so a small U-Net learns it in minutes.

Two flavours:
- ``make_sample``: clean gradients and shapes at one size, the rows every existing dataset and test holds.
- ``make_photo``: the same scene with what a camera adds (uneven light, surface grain, sensor noise), at
  a size drawn per row by ``photo_size``. Noise is what keeps real photos from compressing, so its JPEG
  and PNG bytes (and their decode work) resemble a photo's, where the clean scene compresses several
  times smaller. Every effect is per pixel, never geometric, so the mask stays exactly aligned.
"""

from __future__ import annotations

import io
import math
import os
import sys
from collections.abc import Mapping
from typing import Literal

import numpy as np

CLASSES = ("background", "circle", "rectangle", "triangle")
_HUES = np.array([[210, 60, 50], [60, 190, 70], [60, 90, 220]], dtype=np.float32)  # circle, rect, triangle


def _span(lo: float, hi: float, n: int) -> slice:
    """The pixel rows (or columns) ``[floor(lo) - 1, ceil(hi) + 2)`` clipped to ``[0, n)``: a margin of one
    pixel around a shape's extent, so the float comparisons at its edge see every pixel they would on
    the full grid."""
    return slice(max(0, math.floor(lo) - 1), min(n, math.ceil(hi) + 2))


def make_sample(rng: np.random.Generator, height: int = 256, width: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """One ``(image uint8 [H, W, 3], mask uint8 [H, W])`` pair.

    Each shape is computed inside its own bounding box only (large images cost a fraction of the full
    grid per shape); the values are the same as on the full grid, so existing datasets regenerate
    exactly."""
    yy = np.arange(height, dtype=np.float32)[:, None]
    xx = np.arange(width, dtype=np.float32)[None, :]
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
            ys, xs = _span(cy - r, cy + r, height), _span(cx - r, cx + r, width)
            y, x = yy[ys], xx[:, xs]
            region = (y - cy) ** 2 + (x - cx) ** 2 < r**2
        elif cls == 2:
            hy, hx = r * rng.uniform(0.6, 1.0), r * rng.uniform(0.6, 1.0)
            ys, xs = _span(cy - hy, cy + hy, height), _span(cx - hx, cx + hx, width)
            y, x = yy[ys], xx[:, xs]
            region = (np.abs(y - cy) < hy) & (np.abs(x - cx) < hx)
        else:  # triangle: inside three half-planes
            ang = rng.uniform(0, 2 * np.pi) + np.array([0, 2 * np.pi / 3, 4 * np.pi / 3])
            px, py = cx + r * 1.3 * np.cos(ang), cy + r * 1.3 * np.sin(ang)
            ys, xs = _span(py.min(), py.max(), height), _span(px.min(), px.max(), width)
            y, x = yy[ys], xx[:, xs]
            region = np.ones((y.shape[0], x.shape[1]), bool)
            for i in range(3):
                x0, y0, x1, y1 = px[i], py[i], px[(i + 1) % 3], py[(i + 1) % 3]
                region &= (x1 - x0) * (y - y0) - (y1 - y0) * (x - x0) >= 0
        colour = np.clip(_HUES[cls - 1] + rng.normal(0, 18, 3), 0, 255)
        shade = 0.75 + 0.25 * np.clip(1 - np.sqrt((y - cy) ** 2 + (x - cx) ** 2) / (1.5 * r), 0, 1)
        img[ys, xs][region] = colour[None, :] * shade[region][:, None]
        mask[ys, xs][region] = cls
    return np.clip(img, 0, 255).astype(np.uint8), mask


def photo_size(rng: np.random.Generator, sizes: tuple[int, int], aspect: tuple[float, float]) -> tuple[int, int]:
    """``(height, width)`` of one photo: the long side uniform in ``sizes``, the aspect (width / height)
    log-uniform in ``aspect``, so portrait and landscape are equally likely when the range is symmetric
    around 1 in ratio terms."""
    long_side = int(rng.integers(sizes[0], sizes[1] + 1))
    ratio = math.exp(rng.uniform(math.log(aspect[0]), math.log(aspect[1])))
    short = max(1, round(long_side / ratio if ratio >= 1 else long_side * ratio))
    return (short, long_side) if ratio >= 1 else (long_side, short)


def _field(rng: np.random.Generator, height: int, width: int, cell: int) -> np.ndarray:
    """A smooth random float32 field ``[H, W]`` of about unit variance with features ``cell`` pixels
    across: random values on a coarse grid, upsampled bicubically by PIL, far cheaper than filtering a
    full-size noise image."""
    from PIL import Image

    coarse = rng.standard_normal((max(2, height // cell + 2), max(2, width // cell + 2)), dtype=np.float32)
    return np.asarray(Image.fromarray(coarse, mode="F").resize((width, height), Image.BICUBIC))


def make_photo(rng: np.random.Generator, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """One photo-like ``(image uint8 [H, W, 3], mask uint8 [H, W])``: ``make_sample``'s scene under uneven
    light, with fine grain on every surface and sensor noise. The mask is ``make_sample``'s own."""
    img, mask = make_sample(rng, height, width)
    light = 1.0 + rng.uniform(0.05, 0.2) * _field(rng, height, width, max(height, width) // 3)
    grain = rng.uniform(3.0, 7.0) * _field(rng, height, width, 3)
    # Sensor noise: the sum of two uniform draws (a triangular distribution, close enough to Gaussian)
    # in int8 costs a fraction of a float normal draw.
    noise = rng.integers(-5, 6, img.shape, dtype=np.int8) + rng.integers(-5, 6, img.shape, dtype=np.int8)
    out = img.astype(np.float32) * light[..., None] + grain[..., None] + noise
    return np.clip(out, 0, 255).astype(np.uint8), mask


def encode(array: np.ndarray, fmt: Literal["png", "jpg"], quality: int = 90) -> bytes:
    """The stored bytes of one image or mask, encoded here so that the settings are known: PNG at zlib
    level 6 (PIL's default), JPEG at ``quality`` without chroma subsampling (as ``benchmarks/testbeds/photos.py``).
    Deep Lake stores appended bytes verbatim."""
    from PIL import Image

    buf = io.BytesIO()
    if fmt == "png":
        Image.fromarray(array).save(buf, format="PNG")
    else:
        Image.fromarray(array).save(buf, format="JPEG", quality=quality, subsampling=0)
    return buf.getvalue()


def make_dataset(
    url: str,
    rows: int = 2000,
    *,
    height: int = 256,
    width: int = 256,
    image_format: Literal["png", "jpg"] = "png",
    sizes: tuple[int, int] | None = None,
    aspect: tuple[float, float] = (0.6, 1.7),
    mask_format: Literal["lz4", "png"] = "lz4",
    quality: int = 90,
    seed: int = 0,
    creds: Mapping[str, str] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    chunk: int = 64,
) -> str:
    """Write ``rows`` synthetic samples to a new Deep Lake dataset at ``url`` and return its URL.

    Columns: ``images`` (``Image``, png or jpg, H×W×3 uint8) and ``masks`` (``SegmentMask``, H×W uint8
    class ids, lz4 or png). Row ``i`` depends only on ``(seed, i)``, so a dataset can be regenerated
    exactly.

    By default every row is a clean ``make_sample`` of ``height`` × ``width``, encoded by Deep Lake.
    ``sizes=(lo, hi)`` writes photo-like rows instead (``make_photo``), each of its own size (long side
    in ``[lo, hi]``, width / height in ``aspect``; ``sizes=(256, 256), aspect=(1, 1)`` for one size),
    with images encoded here (JPEG at ``quality``), since a photo dataset's bytes are its point.
    ``mask_format="png"`` stores masks as PNG files encoded here; Deep Lake reads them back as
    ``[H, W, 1]``.
    """
    import deeplake

    from ..sources.deeplake import normalize_url

    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if image_format not in ("png", "jpg"):
        raise ValueError(f"image_format must be 'png' or 'jpg', got {image_format!r}")
    if mask_format not in ("lz4", "png"):
        raise ValueError(f"mask_format must be 'lz4' or 'png', got {mask_format!r}")
    if sizes is not None and not 1 <= sizes[0] <= sizes[1]:
        raise ValueError(f"sizes must be (lo, hi) with 1 <= lo <= hi, got {sizes!r}")
    if not 0 < aspect[0] <= aspect[1]:
        raise ValueError(f"aspect must be (lo, hi) with 0 < lo <= hi, got {aspect!r}")
    if not 1 <= quality <= 100:
        raise ValueError(f"quality must be between 1 and 100, got {quality}")
    url = normalize_url(url)
    cr = dict(creds) if creds else None
    if overwrite and deeplake.exists(url, creds=cr):
        deeplake.delete(url, creds=cr)
    ds = deeplake.create(url, creds=cr)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression=image_format))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression=mask_format))
    ds.metadata["classes"] = list(CLASSES)
    ds["masks"].metadata["class_names"] = list(CLASSES)  # Deep Lake's ClassLabel convention: what train reads
    kind = f" photos sizes={list(sizes)} aspect={list(aspect)} quality={quality}" if sizes else ""
    ds.metadata["generator"] = f"asyncload.tools.synthetic seed={seed}{kind}"
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
        pairs = [_row(np.random.default_rng([seed, start + i]), height, width, sizes, aspect) for i in range(n)]
        images: list[np.ndarray] | list[bytes] = [p[0] for p in pairs]
        masks: list[np.ndarray] | list[bytes] = [p[1] for p in pairs]
        if sizes is not None:
            images = [encode(p[0], image_format, quality) for p in pairs]
        if mask_format == "png":  # Deep Lake would store an array appended to a png column as rows of bytes
            masks = [encode(p[1], "png") for p in pairs]
        ds.append({"images": images, "masks": masks})
        if bar is not None:
            bar.update(n)
    ds.commit(f"{rows} synthetic segmentation samples")
    if bar is not None:
        bar.close()
    del ds
    return url


def _row(
    rng: np.random.Generator, height: int, width: int, sizes: tuple[int, int] | None, aspect: tuple[float, float]
) -> tuple[np.ndarray, np.ndarray]:
    """Row of ``make_dataset``: a clean sample of the fixed size, or a photo of a size drawn first."""
    if sizes is None:
        return make_sample(rng, height, width)
    return make_photo(rng, *photo_size(rng, sizes, aspect))
