"""Photo-like benchmark data: 256×256 crops of the photographs scikit-image ships, with segmentation masks.

Why not ``asyncload.synthetic``: its gradients-and-shapes images compress to ~18 KB as PNG, while
256×256 photographs are 100–150 KB (JPEG q90 20–30 KB), so bytes on the wire and decode work were 5–7×
lower than what a training job reads. Crops of real photographs at random scales, flipped and slightly
re-exposed, have natural-image statistics and sizes; the masks (4 classes from smoothed luminance)
compress with lz4 like label maps do. Row ``i`` depends only on ``(seed, i)``.

    python benchmarks/photos.py data/bench/photos --rows 1000 --format png
"""

from __future__ import annotations

import argparse
import functools
import io
import sys
from collections.abc import Mapping
from typing import Literal

import numpy as np

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "retina", "colorwheel")


@functools.cache
def _sources() -> tuple[np.ndarray, ...]:
    import skimage.data

    return tuple(getattr(skimage.data, name)() for name in PHOTOS)


def photo_sample(rng: np.random.Generator, size: int = 256) -> tuple[np.ndarray, np.ndarray]:
    """One ``(image uint8 [size, size, 3], mask uint8 [size, size])``: a random square crop of a random
    photo, between ``size`` and the photo's short side, resized to ``size``, maybe mirrored, re-exposed."""
    from PIL import Image, ImageFilter

    src = _sources()[int(rng.integers(len(PHOTOS)))]
    h, w = src.shape[:2]
    side = int(rng.integers(min(size, h, w), min(h, w) + 1))
    y, x = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
    img = Image.fromarray(src[y : y + side, x : x + side]).resize((size, size), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.float32)
    if rng.random() < 0.5:
        arr = arr[:, ::-1]
    noise = rng.normal(0, rng.uniform(1.5, 3.5), arr.shape)  # sensor noise: what keeps real photos from compressing
    arr = np.clip(arr * rng.uniform(0.85, 1.15) + rng.uniform(-12, 12) + noise, 0, 255).astype(np.uint8)
    lum = Image.fromarray(arr).convert("L").filter(ImageFilter.BoxBlur(4))
    levels = np.asarray(lum)
    mask = np.digitize(levels, np.percentile(levels, [25, 50, 75])).astype(np.uint8)
    return np.ascontiguousarray(arr), mask


def encode(img: np.ndarray, image_format: Literal["png", "jpg"]) -> bytes:
    """The stored bytes of one image, encoded here rather than by Deep Lake so that the format's settings
    are known: PIL's PNG (zlib level 6), JPEG quality 90 without chroma subsampling. Deep Lake stores
    appended bytes verbatim."""
    from PIL import Image

    buf = io.BytesIO()
    if image_format == "png":
        Image.fromarray(img).save(buf, format="PNG")
    else:
        Image.fromarray(img).save(buf, format="JPEG", quality=90, subsampling=0)
    return buf.getvalue()


def make_photo_dataset(
    url: str,
    rows: int,
    *,
    image_format: Literal["png", "jpg"] = "png",
    size: int = 256,
    seed: int = 0,
    creds: Mapping[str, str] | None = None,
    chunk: int = 64,
) -> str:
    """Write ``rows`` photo-like samples to a new Deep Lake dataset at ``url`` (replacing one there).

    Columns as ``asyncload.synthetic``: ``images`` (``Image``, png or jpg) and ``masks`` (``SegmentMask``, lz4).
    """
    import deeplake

    cr = dict(creds) if creds else None
    if deeplake.exists(url, creds=cr):
        deeplake.delete(url, creds=cr)
    ds = deeplake.create(url, creds=cr)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression=image_format))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="lz4"))
    ds.metadata["generator"] = f"benchmarks/photos.py seed={seed} photos={','.join(PHOTOS)}"
    for start in range(0, rows, chunk):
        pairs = [photo_sample(np.random.default_rng([seed, start + i]), size) for i in range(min(chunk, rows - start))]
        ds.append({"images": [encode(p[0], image_format) for p in pairs], "masks": np.stack([p[1] for p in pairs])})
    ds.commit(f"{rows} photo-like segmentation samples")
    del ds
    return url


def bytes_per_sample(url: str, creds: Mapping[str, str] | None = None, probe: int = 32) -> dict[str, float]:
    """Stored bytes per sample, image and mask, from the raw bytes of the first ``probe`` rows."""
    import deeplake

    ds = deeplake.open_read_only(url, creds=dict(creds)) if creds else deeplake.open_read_only(url)
    n = min(probe, len(ds))
    out = {col: float(np.mean([len(ds[i].get_bytes(col)) for i in range(n)])) for col in ("images", "masks")}
    del ds
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--rows", type=int, default=1000)
    ap.add_argument("--format", choices=["png", "jpg"], default="png")
    args = ap.parse_args(argv)
    make_photo_dataset(args.url, args.rows, image_format=args.format)
    print(bytes_per_sample(args.url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
