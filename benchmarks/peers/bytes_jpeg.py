"""The hand-written bytes reader: the best plain reader, so that asyncload's bar is not Deep Lake's decode.

The plain column reader with one change a strong engineer makes: images are fetched as the stored bytes
(``get_bytes_async``) and decoded by libjpeg-turbo (simplejpeg; OpenCV's libpng for PNG) on a pool of 2
threads, each image straight into its slot of the batch array (no stack copy). Masks stay with Deep
Lake's ``get_async`` (lz4, cheap). Fixed-size images, as the headline datasets have.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import cv2
import numpy as np
import simplejpeg
import torch

from .common import in_order, open_dataset


def decode_into(blobs: list[bytes]) -> np.ndarray:
    """One batch of encoded images into one new uint8 [B, H, W, 3] array (JPEG or PNG, all one size)."""
    if blobs[0][:2] == b"\xff\xd8":
        h, w, _, _ = simplejpeg.decode_jpeg_header(blobs[0])
        out = np.empty((len(blobs), h, w, 3), np.uint8)
        for i, blob in enumerate(blobs):
            simplejpeg.decode_jpeg(blob, colorspace="RGB", buffer=out[i])
        return out
    first = cv2.imdecode(np.frombuffer(blobs[0], np.uint8), cv2.IMREAD_COLOR)
    out = np.empty((len(blobs), *first.shape), np.uint8)
    for i, blob in enumerate(blobs):
        cv2.cvtColor(cv2.imdecode(np.frombuffer(blob, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB, dst=out[i])
    return out


def batches(spec: dict[str, Any], order: list[int], request: int = 64, inflight: int = 4) -> Iterator[Any]:
    ds = open_dataset(spec)
    decoders = ThreadPoolExecutor(2, thread_name_prefix="decode")

    async def fetch(idx: list[int]) -> dict[str, torch.Tensor]:
        blobs, masks = await asyncio.gather(ds["images"].get_bytes_async(idx), ds["masks"].get_async(idx))
        images = await asyncio.get_running_loop().run_in_executor(decoders, decode_into, blobs)
        return {"images": torch.from_numpy(images), "masks": torch.from_numpy(np.stack(masks))}

    yield from in_order(fetch, order, request, inflight)
    decoders.shutdown()
