"""A user's own photos, as a user has them: a folder of JPEGs and PNG masks, every photo its own size.

``photo_folder(root, n)`` writes ``root/images/<name>.jpg`` (JPEG q85–95, 200–800 px a side, any aspect)
and ``root/masks/<name>.png`` (uint8 class ids 0..4: five classes from the photo's blurred luminance, the
way a k-means labelling of colours would split it). Photo-like: smooth structure at several scales,
texture and sensor noise, so JPEG sizes and decode costs are those of photographs, not of flat drawings.
Row ``i`` depends only on ``(seed, i)``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageFilter

CLASS_NAMES = ("water", "sand", "grass", "rock", "sky")  # five classes: not the synthetic set's four


def _field(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A smooth random field in 0..1 of ``h x w``: coarse blobs plus finer detail, like scene structure."""
    out = np.zeros((h, w), np.float32)
    for cells, weight in ((3, 1.0), (9, 0.35), (27, 0.12)):
        small = rng.random((cells, cells)).astype(np.float32)
        out += weight * np.asarray(Image.fromarray(small).resize((w, h), Image.BICUBIC))
    out -= out.min()
    return out / max(float(out.max()), 1e-6)


def photo(rng: np.random.Generator, h: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """One ``(image uint8 [h, w, 3], mask uint8 [h, w])`` with 5 classes."""
    lum = _field(rng, h, w)
    tint = rng.uniform(0.6, 1.0, 3).astype(np.float32)
    hue = _field(rng, h, w)[..., None] * rng.uniform(-60, 60, 3).astype(np.float32)
    img = lum[..., None] * 200 * tint + hue + 30 + rng.normal(0, rng.uniform(2, 5), (h, w, 3))
    arr = np.clip(img, 0, 255).astype(np.uint8)
    levels = np.asarray(Image.fromarray((lum * 255).astype(np.uint8)).filter(ImageFilter.BoxBlur(3)))
    mask = np.digitize(levels, np.percentile(levels, [20, 40, 60, 80])).astype(np.uint8)
    return arr, mask


def photo_folder(root: Path, n: int, seed: int = 0, sizes: tuple[int, int] = (200, 800)) -> Path:
    """``n`` photos and masks under ``root`` (``images/photo_XXXX.jpg``, ``masks/photo_XXXX.png``)."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        h, w = (int(rng.integers(sizes[0], sizes[1] + 1)) for _ in range(2))
        img, mask = photo(rng, h, w)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="JPEG", quality=int(rng.integers(85, 96)))
        (root / "images" / f"photo_{i:04d}.jpg").write_bytes(buf.getvalue())
        Image.fromarray(mask).save(root / "masks" / f"photo_{i:04d}.png")
    return root


def to_deeplake(folder: Path, url: str, class_names: Sequence[str] | None = None, creds: dict | None = None) -> str:
    """The folder as a Deep Lake dataset, bytes stored as they are (the README recipe's way);
    ``class_names``: written to the mask column's metadata, else none (classes then come from the data)."""
    import deeplake

    ds = deeplake.create(url, creds=creds)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="png"))
    if class_names is not None:
        ds["masks"].metadata["class_names"] = list(class_names)
    jpgs = sorted((folder / "images").glob("*.jpg"))
    ds.append({
        "images": [p.read_bytes() for p in jpgs],
        "masks": [(folder / "masks" / f"{p.stem}.png").read_bytes() for p in jpgs],
    })  # fmt: skip
    ds.commit()
    return url
