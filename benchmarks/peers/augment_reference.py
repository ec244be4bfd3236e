"""The augmentation reference: what a strong engineer writes by hand for random-resized-crop training.

Stored bytes (``get_bytes_async`` of images and PNG masks, 64 indices per request, 4 in flight), then on
2 threads per sample: draw the crop box, decode the JPEG with libjpeg-turbo (simplejpeg) at the smallest
DCT scale that still leaves the crop at least 256 px (the crop shrinks anyway, so full-size decoding
would be thrown away), crop, resize with OpenCV (area when shrinking, bilinear when enlarging), mirror,
all straight into a preallocated batch array; the mask likewise (OpenCV's libpng, nearest). Same
geometry as the Pillow transform (``transforms.RandomResizedCropFlip.box``).
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cv2
import numpy as np
import simplejpeg
import torch

from asyncload.runtime.polled import completions  # Deep Lake's Future.__await__ segfaults under GC

from .common import in_order, open_dataset
from .transforms import RandomResizedCropFlip

SIZE = 256


def one(blob: bytes, mask_blob: bytes, draw: RandomResizedCropFlip, image: np.ndarray, mask: np.ndarray) -> None:
    """Decode, crop, resize and maybe mirror one sample into ``image`` [S, S, 3] and ``mask`` [S, S]."""
    h, w, _, _ = simplejpeg.decode_jpeg_header(blob)
    top, left, ch, cw = draw.box(h, w)
    small = simplejpeg.decode_jpeg(
        blob, colorspace="RGB", min_height=math.ceil(h * SIZE / ch), min_width=math.ceil(w * SIZE / cw)
    )
    sy, sx = small.shape[0] / h, small.shape[1] / w
    crop = small[round(top * sy) : round((top + ch) * sy), round(left * sx) : round((left + cw) * sx)]
    shrink = cv2.INTER_AREA if crop.shape[0] >= SIZE and crop.shape[1] >= SIZE else cv2.INTER_LINEAR
    m = cv2.imdecode(np.frombuffer(mask_blob, np.uint8), cv2.IMREAD_UNCHANGED)[top : top + ch, left : left + cw]
    if random.random() < draw.flip:
        cv2.flip(cv2.resize(crop, (SIZE, SIZE), interpolation=shrink), 1, dst=image)
        cv2.flip(cv2.resize(m, (SIZE, SIZE), interpolation=cv2.INTER_NEAREST), 1, dst=mask)
    else:
        cv2.resize(crop, (SIZE, SIZE), dst=image, interpolation=shrink)
        cv2.resize(m, (SIZE, SIZE), dst=mask, interpolation=cv2.INTER_NEAREST)


def batches(spec: dict[str, Any], order: list[int], request: int = 64, inflight: int = 4) -> Iterator[Any]:
    ds = open_dataset(spec)
    pool, draw = ThreadPoolExecutor(2, thread_name_prefix="augment"), RandomResizedCropFlip(SIZE)

    def assemble(blobs: list[bytes], masks: list[bytes]) -> dict[str, torch.Tensor]:
        images, labels = np.empty((len(blobs), SIZE, SIZE, 3), np.uint8), np.empty((len(blobs), SIZE, SIZE), np.uint8)
        for i in range(len(blobs)):
            one(blobs[i], masks[i], draw, images[i], labels[i])
        return {"images": torch.from_numpy(images), "masks": torch.from_numpy(labels)}

    async def fetch(idx: list[int]) -> dict[str, torch.Tensor]:
        blobs, masks = await completions(ds["images"].get_bytes_async(idx), ds["masks"].get_bytes_async(idx))
        return await asyncio.get_running_loop().run_in_executor(pool, assemble, blobs, masks)

    yield from in_order(fetch, order, request, inflight)
    pool.shutdown()
