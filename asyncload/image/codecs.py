"""Stored sample bytes → pixels: which codec, how big, and decoding into a buffer the caller owns.

Why these decoders (chosen per codec by measurement, one sample at a time and on the decode pool's
threads: benchmarks/results/decode.md):

- JPEG: libjpeg-turbo through ``simplejpeg``: writes into a given buffer, and decodes at 1/2, 1/4 or 1/8
  scale for crops that shrink a lot.
- PNG: libspng through ``imagecodecs`` (``spng_decode(out=...)``), straight into the batch row. pyspng wraps
  the same libspng and is a little faster on one thread, but it holds the GIL while it decodes, so two
  decode threads run no faster than one. OpenCV's libpng is the fallback where imagecodecs is missing or
  the PNG is a kind libspng's 8-bit paths do not take (16-bit, grey + alpha).
- lz4 masks (Deep Lake's ``SegmentMask(sample_compression="lz4")``): a 4-byte little-endian size and one
  raw LZ4 block, decompressed by python-lz4 (the GIL released), then one copy into the row. The blob holds
  no shape: the caller gives it (``Header``), from the image the mask is paired with.

All of them release the GIL, so decode threads run in parallel with the loop and the consumer. Pillow is
the fallback for what none takes (palette PNG masks, whose values are palette indices, and formats other
than JPEG and PNG).

Every failure is a ``DecodeError`` carrying the decoder's own message; the caller adds where the bytes came
from (URL, column, row). Bytes are never decoded leniently: a truncated JPEG raises instead of returning
grey pixels.
"""

from __future__ import annotations

import io
import logging
import struct
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import numpy as np

from ..errors import DecodeError
from ..runtime.log import log_once

#: ``rgb``: ``H×W×3`` uint8; ``gray``: ``H×W`` uint8 (class ids, palette indices or grey values).
Mode = Literal["rgb", "gray"]
Role = Literal["image", "mask"]


@dataclass(frozen=True)
class ImageColumn:
    """What the loader knows of an image-like column (here, not in ``decode``, which imports torch: a reader
    process describes its source's columns with it): ``role`` (an image, or a mask of class ids),
    ``stored`` (the codec of its stored bytes when asyncload can decode them, else None: the store
    decodes). "lz4" is for uint8 masks only, and needs an image column to pair with."""

    role: Role
    stored: Literal["jpeg", "png", "lz4", "file"] | None = None  # "file": each file says (object stores)

    @property
    def mode(self) -> Mode:
        return "rgb" if self.role == "image" else "gray"


Format = Literal["jpeg", "png", "lz4", "other"]
Buffer = bytes | bytearray | memoryview


class Header(NamedTuple):
    """What the first bytes say: the format and the stored size (``height``, ``width``). For lz4, whose
    bytes hold no shape, the caller makes it (``lz4_header``). A tuple: one is made per sample and
    column, and a frozen dataclass costs several times as much to build."""

    format: Format
    height: int
    width: int
    palette: bool = False  # a PNG whose pixels are palette indices
    colour: int = -1  # a PNG's colour type (0 grey, 2 RGB, 3 palette, 4 grey + alpha, 6 RGBA)
    depth: int = 8  # a PNG's bits per channel


def is_stored(value: object) -> bool:
    """Whether a read returned ``value`` as stored bytes (to decode), not an array a store decoded:
    ``bytes``, or a view of a larger buffer, as an isolated reader's answers arrive (``isolated``)."""
    return isinstance(value, (bytes, bytearray, memoryview))


def sniff(data: Buffer) -> Format:
    head = bytes(data[:8])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head == b"\x89PNG\r\n\x1a\n":
        return "png"
    return "other"


def header(data: Buffer) -> Header:
    """The format and size of an encoded image, from its header alone (microseconds)."""
    if len(data) == 0:
        raise DecodeError("empty sample (0 bytes)")
    fmt = sniff(data)
    if fmt == "jpeg":
        import simplejpeg

        try:
            h, w, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as exc:
            raise DecodeError(f"libjpeg-turbo: {exc}") from None
        return Header("jpeg", h, w)
    if fmt == "png":
        if len(data) < 33 or bytes(data[12:16]) != b"IHDR":
            raise DecodeError(f"PNG header cut short ({len(data)} bytes)")
        w, h, depth, colour = struct.unpack_from(">IIBB", data, 16)
        return Header("png", h, w, palette=colour == 3, colour=colour, depth=depth)
    try:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as im:
            return Header("other", im.height, im.width, palette=im.mode == "P")
    except Exception as exc:  # noqa: BLE001 - Pillow raises many types for bad bytes
        raise DecodeError(f"not an image Pillow can open ({len(data)} bytes): {exc}") from None


def lz4_header(data: Buffer, height: int, width: int) -> Header:
    """The header of an lz4 mask that is ``height``×``width`` (its paired image's size): raises where the
    blob's own size (its first 4 bytes, little-endian) says otherwise, or where it is cut short."""
    _check_lz4(data, height, width)
    return Header("lz4", height, width)


def _check_lz4(data: Buffer, height: int, width: int) -> None:
    n = lz4_size(data)
    if n < 0:
        raise DecodeError(f"lz4 blob cut short ({len(data)} bytes)")
    if n != height * width:
        raise DecodeError(f"lz4 mask of {n} bytes, but its image is {height}x{width} ({height * width} pixels)")


#: Bytes of the little-endian uncompressed size in front of an lz4 blob's raw block.
LZ4_HEADER = 4


def lz4_size(data: Buffer) -> int:
    """The uncompressed size an lz4 blob declares (its first 4 bytes, little-endian), or -1 for a blob too
    short to hold that size and a block. The one reader of that header: the CPU stage, the device stage
    (``lz4masks``), the pairing check (``decode.unpaired``) and the budget's guess all ask here."""
    view = memoryview(data).cast("B")
    return int.from_bytes(view[:LZ4_HEADER], "little") if len(view) > LZ4_HEADER else -1


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
    if head.format == "lz4":
        return _lz4(data, out, head)
    if head.format == "png" and not (mode == "gray" and head.palette):
        return _png(data, mode, out, head)
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


def _png(data: Buffer, mode: Mode, out: np.ndarray | None, head: Header) -> np.ndarray:
    """libspng (imagecodecs) where it decodes to what ``mode`` asks (8-bit RGB for images, 8-bit grey for
    masks, RGBA losing its alpha), straight into ``out`` when it is the image's size; else OpenCV's libpng."""
    spng = _spng()
    if spng is not None and head.depth == 8 and head.colour in (0, 2, 6):
        exact = (head.colour == 2 and mode == "rgb") or (head.colour == 0 and mode == "gray")
        shape = (head.height, head.width, 3) if mode == "rgb" else (head.height, head.width)
        into = out is not None and exact and out.shape == shape and out.flags.c_contiguous
        try:
            got = spng(data, out=out) if into else spng(data)
        except Exception as exc:  # noqa: BLE001 - imagecodecs' SpngError, or a ValueError on odd bytes
            raise DecodeError(f"libspng: {str(exc).split(' returned ')[-1]}") from None
        return got if into else _finish(got, mode, out)
    return _opencv_png(data, mode, out)


def _spng() -> Any:
    """imagecodecs' ``spng_decode``, or None where imagecodecs is not installed."""
    global _SPNG
    if _SPNG is False:
        try:
            from imagecodecs import spng_decode

            _SPNG = spng_decode
        except ImportError:
            _SPNG = None
            log_once(
                "asyncload: PNG is decoded by OpenCV's libpng: imagecodecs (libspng, faster) is not installed "
                "(pip install 'torch-asyncload[png]')",
                logging.INFO,
            )
    return _SPNG


_SPNG: Any = False


def _opencv_png(data: Buffer, mode: Mode, out: np.ndarray | None) -> np.ndarray:
    """libpng through OpenCV (its IMREAD_COLOR_RGB for images; the stored channels for masks, whose
    first is kept)."""
    import cv2

    buf = np.frombuffer(data, np.uint8)
    got = cv2.imdecode(buf, cv2.IMREAD_COLOR_RGB if mode == "rgb" else cv2.IMREAD_UNCHANGED)
    if got is None:
        raise DecodeError(f"libpng (OpenCV) could not decode these {len(buf)} bytes: damaged or cut short")
    if mode == "gray" and got.ndim == 3:  # stored with channels: OpenCV gives BGR(A), the first stored is R
        got = got[..., 2] if got.shape[2] >= 3 else got[..., 0]
    return _finish(got, mode, out)


def _lz4(data: Buffer, out: np.ndarray | None, head: Header) -> np.ndarray:
    """One raw LZ4 block after a 4-byte size (Deep Lake's lz4 sample), as ``head``'s height×width."""
    import lz4.block

    _check_lz4(data, head.height, head.width)  # the declared size is the pair's: else raise, decode nothing
    try:
        # As ``bytes``: ``return_bytearray=True`` cost more than the rest of a mask's decode together (a
        # copy inside python-lz4), and a mask is copied into its batch row anyway.
        raw = lz4.block.decompress(data)
    except lz4.block.LZ4BlockError as exc:
        raise DecodeError(f"lz4: {exc}") from None
    got = np.frombuffer(raw, np.uint8).reshape(head.height, head.width)
    if out is None:
        return got.copy()  # writable: a row of its own
    if out.shape == got.shape:
        out[...] = got
        return out
    return _finish(got, "gray", out)


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


__all__ = [
    "LZ4_HEADER", "DecodeError", "Header", "ImageColumn", "Mode", "Role", "decode", "header", "is_stored",
    "lz4_header", "lz4_size", "sniff",
]  # fmt: skip
