"""NVIDIA DALI as a peer of asyncload's GPU path (issue 23): the same stored bytes, crop, flip and normalize.

DALI reads nothing itself here: Deep Lake's stored bytes (``get_bytes``: JPEG images, lz4 mask blobs) are
fed through ``fn.external_source``, a batch at a time, in the same shuffled order; the crop box and flip of
each row are asyncload's own draws (``Augment.draws``), so both loaders produce the same geometry. Images:
``fn.decoders.image(device="mixed")`` (nvJPEG), ``fn.slice`` to the box, ``fn.resize`` to the output size,
``fn.crop_mirror_normalize`` (mirror, ``ToDtype(scale=True)`` + ``Normalize`` as mean·255 / std·255, CHW,
float16: DALI has no bfloat16). Masks: python-lz4 on the feeding thread (DALI has no LZ4 decoder), then the
same slice, nearest-neighbour resize and flip on the GPU. Written from DALI's documentation; not run yet
(no GPU in the session that wrote it).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def dali_available() -> bool:
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return False
    return True


def dali_epoch(url: str, batch_size: int, out_size: tuple[int, int], ops: list[Any], cpu_s: Any) -> dict[str, Any]:
    """One shuffled epoch through DALI; pairs/s and CPU ms per pair (``cpu_s()``: the process tree's)."""
    import deeplake
    import lz4.block
    import nvidia.dali.fn as fn
    import nvidia.dali.types as types
    from nvidia.dali import pipeline_def

    from asyncload.image.augment import Augment

    ds = deeplake.open_read_only(url)
    n = len(ds)
    order = np.random.default_rng(0).permutation(n)
    aug = Augment(ops)
    batches = [order[s : s + batch_size].tolist() for s in range(0, n, batch_size)]

    def feed(info: Any) -> tuple[list[np.ndarray], ...]:
        if info.iteration >= len(batches):
            raise StopIteration
        rows = batches[info.iteration]
        jpegs = ds["images"].get_bytes(rows)
        blobs = ds["masks"].get_bytes(rows)
        import simplejpeg

        sizes = [simplejpeg.decode_jpeg_header(b)[:2] for b in jpegs]
        draws = aug.draws(0, 0, rows, sizes)
        masks = [
            np.frombuffer(lz4.block.decompress(b), np.uint8).reshape(*hw, 1) for b, hw in zip(blobs, sizes, strict=True)
        ]
        return (
            [np.frombuffer(b, np.uint8) for b in jpegs],
            masks,
            [np.array(d.box[:2], np.int32) for d in draws],  # anchor (y, x)
            [np.array(d.box[2:], np.int32) for d in draws],  # shape (h, w)
            [np.array(int(d.flip), np.int32) for d in draws],
        )

    @pipeline_def(batch_size=batch_size, num_threads=4, device_id=0, prefetch_queue_depth=2)
    def pairs() -> tuple[Any, Any]:
        jpegs, masks, anchor, shape, flip = fn.external_source(
            source=feed, num_outputs=5, batch=True, parallel=False, layout=["", "HWC", "", "", ""]
        )
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB)
        images = fn.slice(images, anchor, shape, axis_names="HW")
        images = fn.resize(images, size=list(out_size), antialias=True)
        images = fn.crop_mirror_normalize(
            images, mirror=flip, dtype=types.FLOAT16, output_layout="CHW",
            mean=[255 * m for m in MEAN], std=[255 * s for s in STD],
        )  # fmt: skip
        masks = fn.slice(masks.gpu(), anchor, shape, axis_names="HW")
        masks = fn.resize(masks, size=list(out_size), interp_type=types.INTERP_NN)
        masks = fn.flip(masks, horizontal=flip)
        return images, masks

    pipe = pairs()
    pipe.build()
    c0, t0, got = cpu_s(), time.perf_counter(), 0
    for _ in batches:
        images, _masks = pipe.run()
        got += len(images)
    wall, cpu = time.perf_counter() - t0, cpu_s() - c0
    return {"reader": "NVIDIA DALI (same bytes, crop, flip, normalize; fp16 CHW)", "samples_per_s": got / wall,
            "cpu_ms_per_sample": 1e3 * cpu / got, "samples": got}  # fmt: skip


__all__ = ["dali_available", "dali_epoch"]
