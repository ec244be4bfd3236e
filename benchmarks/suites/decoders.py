"""Decoders one sample at a time, on one thread: the measurement behind ``asyncload/image/codecs.py``'s
choice per codec (PNG images and masks, lz4 masks; JPEG for reference).

Data: photo-like 256×256 samples (``testbeds/photos.py``: crops of photographs with sensor noise), PNG
images and masks, JPEG q90 images, lz4 masks, written to a local Deep Lake dataset so that Deep Lake's
own decode is timed on the same bytes (one ``ds[col].get_async(list)`` of all rows, per image).

    python -m benchmarks.suites.decoders [--rows 64] [--passes 5] [--out benchmarks/results/decode.md]

Every decoder's pixels are checked equal to Deep Lake's before its time counts.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from asyncload.runtime.polled import completion  # Deep Lake's Future.__await__ segfaults under GC


def _best_ms(fn: Callable[[Any], Any], items: list[Any], passes: int) -> float:
    """Median over ``passes`` of the mean ms per item, on this thread (one warm-up pass first)."""
    for it in items:
        fn(it)
    per = []
    for _ in range(passes):
        t = time.perf_counter()
        for it in items:
            fn(it)
        per.append((time.perf_counter() - t) / len(items) * 1e3)
    return float(np.median(per))


def _deeplake_ms(ds: Any, col: str, n: int, passes: int) -> float:
    """Deep Lake's own decode: one column ``get_async`` of every row, CPU ms per sample (process CPU time:
    its decode runs on several threads at once, so wall time would flatter it against one thread)."""

    async def once() -> None:
        await completion(ds[col].get_async(list(range(n))))

    asyncio.run(once())
    per = []
    for _ in range(passes):
        t = time.process_time()
        asyncio.run(once())
        per.append((time.process_time() - t) / n * 1e3)
    return float(np.median(per))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--passes", type=int, default=5)
    args = p.parse_args(argv)

    import cv2
    import deeplake
    import imagecodecs
    import lz4.block
    import pyspng
    import simplejpeg

    from benchmarks.testbeds.photos import encode, photo_sample

    cv2.setNumThreads(1)
    deeplake.storage.set_concurrency(1)
    rows = [photo_sample(np.random.default_rng([7, i]), 256) for i in range(args.rows)]
    png = [encode(img, "png") for img, _ in rows]
    jpg = [encode(img, "jpg") for img, _ in rows]
    mpng = [encode(m, "png") for _, m in rows]
    tmp = tempfile.mkdtemp()
    ds = deeplake.create(f"file://{tmp}/ds")
    ds.add_column("png", deeplake.types.Image(dtype="uint8", sample_compression="png"))
    ds.add_column("jpg", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
    ds.add_column("mpng", deeplake.types.SegmentMask(dtype="uint8", sample_compression="png"))
    ds.add_column("mlz4", deeplake.types.SegmentMask(dtype="uint8", sample_compression="lz4"))
    ds.append({"png": png, "jpg": jpg, "mpng": mpng, "mlz4": np.stack([m for _, m in rows])})
    ds.commit()
    ds = deeplake.open_read_only(f"file://{tmp}/ds")
    lz4b = ds["mlz4"].get_bytes(list(range(args.rows)))
    ref = {c: [np.asarray(a) for a in ds[c][list(range(args.rows))]] for c in ("png", "jpg", "mpng", "mlz4")}

    out3 = np.empty((256, 256, 3), np.uint8)
    out2 = np.empty((256, 256), np.uint8)

    def png_decoders(out: np.ndarray, spng_mode: str, cv2_flag: int) -> dict[str, Callable[[bytes], np.ndarray]]:
        """The PNG decoders measured, each writing into ``out`` (an image's row or a mask's)."""
        return {
            "pyspng (libspng), then one copy into the row": lambda b: np.copyto(out, pyspng.load(b, spng_mode)) or out,
            "imagecodecs spng_decode (libspng), out=row": lambda b: imagecodecs.spng_decode(b, out=out),
            "imagecodecs png_decode (libpng), out=row": lambda b: imagecodecs.png_decode(b, out=out),
            "OpenCV imdecode (libpng), then one copy": lambda b: (
                np.copyto(out, cv2.imdecode(np.frombuffer(b, np.uint8), cv2_flag)) or out
            ),  # fmt: skip
        }

    png_rgb = png_decoders(out3, "RGB", cv2.IMREAD_COLOR_RGB)
    png_gray = png_decoders(out2, "L", cv2.IMREAD_UNCHANGED)
    lz4s: dict[str, Callable[[bytes], np.ndarray]] = {
        "python-lz4 lz4.block.decompress, then one copy": lambda b: (
            np.copyto(out2, np.frombuffer(lz4.block.decompress(b), np.uint8).reshape(256, 256)) or out2
        ),  # fmt: skip
        "imagecodecs lz4_decode(header=True), out=row": lambda b: (
            imagecodecs.lz4_decode(b, header=True, out=out2.reshape(-1)),
            out2,
        )[1],  # fmt: skip
    }
    jpgs: dict[str, Callable[[bytes], np.ndarray]] = {
        "simplejpeg (libjpeg-turbo), buffer=row": lambda b: simplejpeg.decode_jpeg(
            b, colorspace="RGB", buffer=out3.reshape(-1)
        ),  # fmt: skip
    }
    table: list[tuple[str, str, float]] = []
    for kind, data, decs, col in (
        ("PNG image", png, png_rgb, "png"),
        ("PNG mask", mpng, png_gray, "mpng"),
        ("lz4 mask", lz4b, lz4s, "mlz4"),
        ("JPEG image", jpg, jpgs, "jpg"),
    ):
        for name, fn in decs.items():
            for k, b in enumerate(data[:8]):
                got = fn(b)
                want = ref[col][k].reshape(np.shape(got))
                assert np.array_equal(got, want), f"{name} differs from Deep Lake on {kind} {k}"
            table.append((kind, name, _best_ms(fn, data, args.passes)))
        table.append((kind, "Deep Lake 4.7.4 column get_async (CPU time of all its threads)",
                      _deeplake_ms(ds, col, args.rows, args.passes)))  # fmt: skip
    sizes = {
        k: np.mean([len(b) for b in v]) / 1e3 for k, v in (("png", png), ("jpg", jpg), ("mpng", mpng), ("lz4", lz4b))
    }
    print(f"{args.rows} photo-like 256x256 samples: PNG {sizes['png']:.0f} KB, JPEG q90 {sizes['jpg']:.0f} KB, "
          f"PNG mask {sizes['mpng']:.1f} KB, lz4 mask {sizes['lz4']:.1f} KB; median of {args.passes} passes")  # fmt: skip
    print("| sample | decoder | ms per sample |\n|---|---|---|")
    for kind, name, ms in table:
        print(f"| {kind} | {name} | {ms:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
