"""Stored image bytes → pixels: which codec, how big, and decoding into a buffer the caller owns.

Why these decoders: libjpeg-turbo through ``simplejpeg`` (fastest measured JPEG decode here, writes into a
given buffer, and decodes at 1/2, 1/4 or 1/8 scale for crops that shrink a lot) and libpng through OpenCV
(already a dependency for the geometry; see ``_png`` for why not libspng). Both release the GIL, so decode
threads run in parallel with the loop and the consumer. Pillow is the fallback for what neither takes
(palette PNG masks, whose values are palette indices, and formats other than JPEG and PNG). The
measurements behind the choice are in benchmarks/results/decode.md.

Every failure is a ``DecodeError`` carrying the decoder's own message; the caller adds where the bytes came
from (URL, column, row). Bytes are never decoded leniently: a truncated JPEG raises instead of returning
grey pixels.
"""

from __future__ import annotations

import io
import struct
from dataclasses import dataclass
from typing import Literal

import numpy as np

#: ``rgb``: ``H×W×3`` uint8; ``gray``: ``H×W`` uint8 (class ids, palette indices or grey values).
Mode = Literal["rgb", "gray"]
Format = Literal["jpeg", "png", "other"]
Buffer = bytes | bytearray | memoryview


class DecodeError(ValueError):
    """Bytes that do not decode as the image they claim to be; the message is the decoder's."""


@dataclass(frozen=True)
class Header:
    """What the first bytes say: the format and the stored size (``height``, ``width``)."""

    format: Format
    height: int
    width: int
    palette: bool = False  # a PNG whose pixels are palette indices


def sniff(data: Buffer) -> Format:
    head = bytes(memoryview(data)[:8])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head == b"\x89PNG\r\n\x1a\n":
        return "png"
    return "other"


def header(data: Buffer) -> Header:
    """The format and size of an encoded image, from its header alone (microseconds)."""
    view = memoryview(data)
    if len(view) == 0:
        raise DecodeError("empty sample (0 bytes)")
    fmt = sniff(view)
    if fmt == "jpeg":
        import simplejpeg

        try:
            h, w, _, _ = simplejpeg.decode_jpeg_header(view)
        except ValueError as exc:
            raise DecodeError(f"libjpeg-turbo: {exc}") from None
        return Header("jpeg", h, w)
    if fmt == "png":
        if len(view) < 33 or bytes(view[12:16]) != b"IHDR":
            raise DecodeError(f"PNG header cut short ({len(view)} bytes)")
        w, h, _depth, colour = struct.unpack(">IIBB", view[16:26])
        return Header("png", h, w, palette=colour == 3)
    try:
        from PIL import Image

        with Image.open(io.BytesIO(view)) as im:
            return Header("other", im.height, im.width, palette=im.mode == "P")
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad bytes
        raise DecodeError(f"not an image Pillow can open ({len(view)} bytes): {exc}") from None


def decode(
    data: Buffer, mode: Mode, out: np.ndarray | None = None, *, reduce: int = 1, head: Header | None = None
) -> np.ndarray:
    """Decode ``data`` into ``out`` (``H×W×3`` or ``H×W`` uint8, C-contiguous) or a new array.

    ``reduce`` (1, 2, 4 or 8): JPEG only, decode at about 1/``reduce`` of the stored size (libjpeg-turbo's
    scaled IDCT: much less work); the returned array says the size it got. ``out`` must then be at least
    that big; the result is a view of its top-left corner. ``head``: ``header(data)``, when known.
    """
    head = head or header(data)
    if head.format == "jpeg":
        return _jpeg(data, mode, out, head, reduce)
    if head.format == "png" and not (mode == "gray" and head.palette):
        return _png(data, mode, out)
    return _pillow(data, mode, out)


def _jpeg(data: Buffer, mode: Mode, out: np.ndarray | None, head: Header, reduce: int) -> np.ndarray:
    import simplejpeg

    kw = {}
    if reduce > 1:  # the smallest size that keeps at least 1/reduce of each side
        kw = {"min_height": -(-head.height // reduce), "min_width": -(-head.width // reduce), "min_factor": 1}
    try:
        if out is None:
            return simplejpeg.decode_jpeg(data, colorspace="RGB" if mode == "rgb" else "GRAY", strict=True, **kw)
        buf = out.reshape(-1) if out.flags.c_contiguous else out
        got = simplejpeg.decode_jpeg(data, colorspace="RGB" if mode == "rgb" else "GRAY", strict=True, buffer=buf, **kw)
    except ValueError as exc:
        raise DecodeError(f"libjpeg-turbo: {exc}") from None
    if got.ndim == 3 and mode == "gray":
        got = got[..., 0]
    return got


def _png(data: Buffer, mode: Mode, out: np.ndarray | None) -> np.ndarray:
    """libpng through OpenCV (its IMREAD_COLOR_RGB for images; the stored channels for masks, whose
    first is kept). Not imagecodecs' libspng, though it is a third faster: with it on the decode threads,
    full test runs under load segfaulted (see docs/ARCHITECTURE.md)."""
    import cv2

    buf = np.frombuffer(data, np.uint8)
    got = cv2.imdecode(buf, cv2.IMREAD_COLOR_RGB if mode == "rgb" else cv2.IMREAD_UNCHANGED)
    if got is None:
        raise DecodeError(f"libpng (OpenCV) could not decode these {len(buf)} bytes: damaged or cut short")
    if mode == "gray" and got.ndim == 3:  # stored with channels: OpenCV gives BGR(A), the first stored is R
        got = got[..., 2] if got.shape[2] >= 3 else got[..., 0]
    return _finish(got, mode, out)


def _pillow(data: Buffer, mode: Mode, out: np.ndarray | None) -> np.ndarray:
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
            if mode == "rgb":
                got = np.asarray(im if im.mode == "RGB" else im.convert("RGB"))
            elif im.mode in ("L", "P"):
                got = np.asarray(im)
            elif im.mode == "1":
                got = np.asarray(im).astype(np.uint8)
            else:
                got = np.asarray(im if im.mode in ("RGB", "RGBA", "LA") else im.convert("L"))
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad bytes
        raise DecodeError(f"Pillow: {exc}") from None
    return _finish(got, mode, out)


def _finish(got: np.ndarray, mode: Mode, out: np.ndarray | None) -> np.ndarray:
    """``got`` as ``mode`` asks (a mask stored with channels keeps its first), copied into ``out``."""
    if got.dtype != np.uint8:
        raise DecodeError(f"decodes to {got.dtype}, expected 8-bit data")
    if mode == "gray" and got.ndim == 3:
        got = got[..., 0]
    elif mode == "rgb":
        if got.ndim == 2:
            got = np.repeat(got[..., None], 3, axis=2)
        elif got.shape[2] == 4:
            got = got[..., :3]
        elif got.shape[2] == 1:
            got = np.repeat(got, 3, axis=2)
    if out is None or got is out:
        return got
    if np.shares_memory(got, out):
        return got
    region = out[: got.shape[0], : got.shape[1]]
    region[...] = got
    return region


__all__ = ["DecodeError", "Header", "Mode", "decode", "header", "sniff"]
