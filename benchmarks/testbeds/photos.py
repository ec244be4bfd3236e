"""Photo-like benchmark data: crops of the photographs scikit-image ships, with segmentation masks.

Why not ``asyncload.tools.synthetic``: its gradients-and-shapes images compress to ~18 KB as PNG, while
256×256 photographs are 100–150 KB (JPEG q90 20–30 KB), so bytes on the wire and decode work were 5–7×
lower than what a training job reads. Crops of real photographs at random scales, flipped and slightly
re-exposed, have natural-image statistics and sizes; the masks (4 classes from smoothed luminance)
compress with lz4 like label maps do. Row ``i`` depends only on ``(seed, i)``.

Three shapes, one per question:

- fixed 256×256 (``size=256``): the WAN suite's headline rows, JPEG q90 (~20 KB) or PNG (~120 KB);
- variable (``size=None``): 240–640 px on the long side, aspect (width / height) 0.6–1.7, PNG masks: what
  a random-resized-crop training job reads (the augmentation suite);
- large (``size=2048``): 2048×2048 photos (~600 KB as JPEG), where a decoded batch is 400 MB and the
  loader's byte budget, not its sample count, bounds memory.

Without scikit-image (a GPU node given only the wheelhouse: scikit-image and SciPy would double it),
``drawn_sample`` draws photo-like rows from numpy and Pillow alone: ``make gpu-check``'s data
(``benchmarks/suites/gpu_check.py``).

    python benchmarks/testbeds/photos.py data/bench/photos --rows 1000 --format png [--size 256|0|2048]
"""

from __future__ import annotations

import argparse
import functools
import io
import sys
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

PHOTOS = ("astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry", "retina", "colorwheel")


@functools.cache
def _sources() -> tuple[np.ndarray, ...]:
    import skimage.data

    return tuple(getattr(skimage.data, name)() for name in PHOTOS)


#: Variable-size rows: the long side in pixels and the aspect ratio (width / height), both uniform.
LONG_SIDE, ASPECT = (240, 640), (0.6, 1.7)


def variable_shape(rng: np.random.Generator) -> tuple[int, int]:
    """(height, width) of one variable-size row."""
    long, aspect = int(rng.integers(LONG_SIDE[0], LONG_SIDE[1] + 1)), float(rng.uniform(*ASPECT))
    return (round(long / aspect), long) if aspect >= 1 else (long, round(long * aspect))


def photo_sample(
    rng: np.random.Generator, size: int | tuple[int, int] = 256, noise_std: tuple[float, float] = (1.5, 3.5)
) -> tuple[np.ndarray, np.ndarray]:
    """One ``(image uint8 [h, w, 3], mask uint8 [h, w])`` of ``size`` (an int: square): a random crop of
    a random photo with the target's aspect, between the target and the photo's size, resized to it,
    maybe mirrored, re-exposed, with sensor noise of a standard deviation drawn from ``noise_std``."""
    from PIL import Image, ImageFilter

    src = _sources()[int(rng.integers(len(PHOTOS)))]
    h, w = src.shape[:2]
    if isinstance(size, int):  # a square crop between ``size`` and the photo's short side
        th = tw = size
        ch = cw = int(rng.integers(min(size, h, w), min(h, w) + 1))
    else:  # the largest crop of the target's aspect the photo holds, scaled down by up to its slack
        th, tw = size
        fit = min(h / th, w / tw)
        scale = float(rng.uniform(1.0, fit)) if fit > 1 else fit
        ch, cw = max(1, min(h, round(th * scale))), max(1, min(w, round(tw * scale)))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    img = Image.fromarray(src[y : y + ch, x : x + cw]).resize((tw, th), Image.BILINEAR)
    arr = np.asarray(img, dtype=np.float32)
    if rng.random() < 0.5:
        arr = arr[:, ::-1]
    noise = rng.normal(0, rng.uniform(*noise_std), arr.shape)  # sensor noise: what keeps photos from compressing
    arr = np.clip(arr * rng.uniform(0.85, 1.15) + rng.uniform(-12, 12) + noise, 0, 255).astype(np.uint8)
    lum = Image.fromarray(arr).convert("L").filter(ImageFilter.BoxBlur(4))
    levels = np.asarray(lum)
    mask = np.digitize(levels, np.percentile(levels, [25, 50, 75])).astype(np.uint8)
    return np.ascontiguousarray(arr), mask


def _smooth(rng: np.random.Generator, height: int, width: int, cell: int) -> np.ndarray:
    """A smooth random field ``[H, W]`` of unit variance with features ``cell`` pixels across: noise on a
    coarse grid, upsampled bicubically (far cheaper than filtering full-size noise)."""
    from PIL import Image

    coarse = rng.standard_normal((max(2, height // cell + 2), max(2, width // cell + 2))).astype(np.float32)
    return np.asarray(Image.fromarray(coarse, mode="F").resize((width, height), Image.BICUBIC))


def _texture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Detail at every scale, each octave's amplitude growing with its size as in natural images (a
    spectrum falling roughly as 1/f): what makes a photo's JPEG tens of KB where a flat scene's is a few."""
    octaves = [(cell, cell**0.4) for cell in (64, 24, 8, 3, 2)]
    field = sum(amp * _smooth(rng, height, width, cell) for cell, amp in octaves)
    return field / np.sqrt(sum(amp**2 for _, amp in octaves))  # unit variance


def drawn_sample(
    rng: np.random.Generator, size: int = 256, noise_std: tuple[float, float] = (1.5, 3.5)
) -> tuple[np.ndarray, np.ndarray]:
    """One photo-like ``(image uint8 [size, size, 3], mask uint8 [size, size])`` from numpy and Pillow,
    without scikit-image: ``asyncload.tools.synthetic``'s scene (a colour gradient, 1-4 shaded circles,
    rectangles and triangles; the mask holds their classes) with a texture of its own on the background
    and on every shape, uneven light, and sensor noise of a standard deviation drawn from ``noise_std``.
    Its 256x256 JPEG q90 is ~22 KB (16-25), as a crop of the photographs is 20-30 KB (``photo_sample``)."""
    from asyncload.tools.synthetic import make_sample

    img, mask = make_sample(rng, size, size)
    out = img.astype(np.float32)
    for cls in np.unique(mask):  # every surface its own material: contrast and tint of its texture
        region = mask == cls
        tint = rng.uniform(0.6, 1.0, 3).astype(np.float32)
        out[region] += rng.uniform(22, 48) * _texture(rng, size, size)[region][:, None] * tint
    out *= 1.0 + rng.uniform(0.05, 0.2) * _smooth(rng, size, size, size // 3)[..., None]
    out += rng.normal(0, rng.uniform(*noise_std), out.shape)
    return np.clip(out, 0, 255).astype(np.uint8), mask


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


def _encoded_row(args: tuple[int, int, int | None, str, str, tuple[float, float]]) -> tuple[bytes, Any]:
    """Row ``i``'s stored image bytes and its mask (PNG bytes, or the array for lz4): a pool worker's task."""
    seed, i, size, image_format, mask_format, noise_std = args
    rng = np.random.default_rng([seed, i])
    img, mask = photo_sample(rng, size if size is not None else variable_shape(rng), noise_std)
    return encode(img, image_format), (encode(mask, "png") if mask_format == "png" else mask)  # type: ignore[arg-type]


def make_photo_dataset(
    url: str,
    rows: int,
    *,
    image_format: Literal["png", "jpg"] = "png",
    size: int | None = 256,
    mask_format: Literal["lz4", "png"] = "lz4",
    noise_std: tuple[float, float] = (1.5, 3.5),
    seed: int = 0,
    creds: Mapping[str, str] | None = None,
    chunk: int = 64,
    distinct: int | None = None,
    processes: int = 1,
) -> str:
    """Write ``rows`` photo-like samples to a new Deep Lake dataset at ``url`` (replacing one there).

    Columns as ``asyncload.tools.synthetic``: ``images`` (``Image``, png or jpg) and ``masks`` (``SegmentMask``,
    lz4, or PNG bytes stored verbatim). ``size``: a side in pixels, or ``None`` for variable shapes
    (``variable_shape``).

    ``distinct``: make only this many different rows and store each ``rows / distinct`` times, row ``i``
    holding distinct row ``(i * 7919) % distinct``, so that neighbours differ. A crop costs ~17 ms of CPU
    and a several-GB dataset 100,000 of them; what a reader's I/O sees (bytes per row, their layout in
    chunks, the decode work) is the same either way, since Deep Lake stores every appended row's bytes
    as given. ``processes``: pool workers making the distinct rows."""
    import deeplake

    cr = dict(creds) if creds else None
    if deeplake.exists(url, creds=cr):
        deeplake.delete(url, creds=cr)
    ds = deeplake.create(url, creds=cr)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression=image_format))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression=mask_format))
    ds.metadata["generator"] = (
        f"benchmarks/testbeds/photos.py seed={seed} size={size} masks={mask_format} photos={','.join(PHOTOS)}"
        + (f" distinct={distinct}" if distinct else "")
    )
    unique = min(distinct or rows, rows)
    tasks = ((seed, i, size, image_format, mask_format, noise_std) for i in range(unique))
    if processes > 1:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            made = pool.map(_encoded_row, tasks, chunksize=64)
    else:
        made = [_encoded_row(t) for t in tasks] if distinct else []
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        if made:
            pairs = [made[(i * 7919) % unique if distinct else i] for i in range(start, stop)]
        else:  # one pass, nothing kept: every row distinct
            pairs = [_encoded_row((seed, i, size, image_format, mask_format, noise_std)) for i in range(start, stop)]
        images = [p[0] for p in pairs]
        masks: Any = [p[1] for p in pairs] if mask_format == "png" else np.stack([p[1] for p in pairs])
        ds.append({"images": images, "masks": masks})
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
    ap.add_argument("--size", type=int, default=256, help="side in pixels; 0: variable shapes with PNG masks")
    args = ap.parse_args(argv)
    variable = args.size == 0
    make_photo_dataset(
        args.url, args.rows, image_format=args.format, size=None if variable else args.size,
        mask_format="png" if variable else "lz4",
    )  # fmt: skip
    print(bytes_per_sample(args.url))
    return 0


if __name__ == "__main__":
    sys.exit(main())
