"""Deep Lake's lz4 segmentation masks decoded without Deep Lake, for the GPU decode stage (``gpu``).

Why: with ``decode="cuda"`` the masks went through Deep Lake's own decode (``get_async``), which held
image + mask pairs to a fraction of what nvJPEG decodes. A stored lz4 mask is a 4-byte little-endian
uncompressed size followed by one raw LZ4 block (``shared/DEEPLAKE_NOTES.md``), so its stored bytes
(``get_bytes``) can be decompressed here, two ways, chosen per batch (``choose``):

- ``"cpu"``: python-lz4 on the thread that runs the batch (the loader's CPU pool; GIL released), each
  mask straight into its place in one page-locked buffer, then one host-to-device copy for the batch;
- ``"nvcomp"``: the batch's raw LZ4 blocks copied to the device in one copy and decompressed by nvCOMP
  (``nvidia-nvcomp-cu12``) in one batched call on the current CUDA stream.

The blob holds no shape: a mask is the height and width of the image it is paired with, and a size that
does not match is an error of that sample. The masks' crop, resize and flip then run on the device with
their images, as before (``gpu.place``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal

import numpy as np
import torch

from .codecs import LZ4_HEADER, DecodeError, lz4_header, lz4_size

Way = Literal["cpu", "nvcomp"]
#: Masks per batch from which ``choose`` sends a batch to nvCOMP. A guess, not a measurement: one
#: batched kernel launch and its setup cost about what python-lz4 spends on a few 256² masks.
NVCOMP_FROM = 16


def nvcomp_available() -> bool:
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:
        return False
    return True


def choose(count: int, device: torch.device) -> Way:
    """Where a batch of ``count`` masks is decompressed: nvCOMP on a CUDA device with ``NVCOMP_FROM`` masks
    or more when it imports, else python-lz4. Unmeasured on a GPU so far (see ``NVCOMP_FROM``)."""
    if device.type == "cuda" and count >= NVCOMP_FROM and nvcomp_available():
        return "nvcomp"
    return "cpu"


def decode_batch(
    blobs: Sequence[Any],
    shapes: Sequence[tuple[int, int] | None],
    device: torch.device,
    fail: Callable[[int, BaseException], None],
    way: Way | None = None,
) -> list[torch.Tensor | None]:
    """Each blob as a ``1×H×W`` uint8 tensor on ``device`` (None where it failed: ``fail(k, exc)`` was
    called). ``shapes[k]``: the (height, width) of the image paired with mask ``k`` (None: that image
    failed, so the mask is left out too)."""
    out: list[torch.Tensor | None] = [None] * len(blobs)
    todo: list[int] = []
    for k, (blob, shape) in enumerate(zip(blobs, shapes, strict=True)):
        if shape is None:
            continue
        try:
            lz4_header(blob, *shape)  # its declared size is its image's (the CPU stage's check)
        except DecodeError as exc:
            fail(k, exc)
            continue
        todo.append(k)
    if not todo:
        return out
    way = way or choose(len(todo), device)
    decode = _nvcomp if way == "nvcomp" else _cpu
    for k, t in zip(todo, decode([blobs[k] for k in todo], device, lambda j, e: fail(todo[j], e)), strict=True):
        if t is not None:
            h, w = shapes[k]  # type: ignore[misc]
            out[k] = t.view(1, h, w)
    return out


# -- python-lz4 into one pinned buffer ------------------------------------------------------------------

_local = threading.local()


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """This thread's staging buffer of at least ``nbytes`` (page-locked when ``pinned``), reused across
    batches once the copy that last read it has completed; a page-locked allocation per batch would
    cost a ``cudaHostAlloc`` each time."""
    buf: torch.Tensor | None = getattr(_local, "buf", None)
    event = getattr(_local, "event", None)
    if event is not None:
        event.synchronize()  # the previous batch's copy out of it is done
        _local.event = None
    if buf is None or buf.numel() < nbytes or buf.is_pinned() != pinned:
        buf = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, pin_memory=pinned)
        _local.buf = buf
    return buf[:nbytes]


def decompress_into(blobs: Sequence[Any], dst: np.ndarray, fail: Callable[[int, BaseException], None]) -> list[int]:
    """Decompress each blob (python-lz4) into its slice of ``dst`` (one after another, each its declared
    size); returns the offsets. A block that does not decompress to its declared size, or a blob too short
    to declare one, is ``fail``-ed."""
    import lz4.block

    offsets, at = [], 0
    for k, blob in enumerate(blobs):
        n = max(lz4_size(blob), 0)
        offsets.append(at)
        try:
            raw = lz4.block.decompress(blob)
            if len(raw) != n:
                raise DecodeError(f"lz4 block decompressed to {len(raw)} bytes, its header says {n}")
            dst[at : at + n] = np.frombuffer(raw, np.uint8)
        except (lz4.block.LZ4BlockError, ValueError) as exc:
            fail(k, exc if isinstance(exc, DecodeError) else DecodeError(f"lz4: {exc}"))
        at += n
    return offsets


def _cpu(blobs: Sequence[Any], device: torch.device, fail: Callable[[int, BaseException], None]) -> list[Any]:
    sizes = [max(lz4_size(b), 0) for b in blobs]
    cuda = device.type == "cuda"
    host = host_buffer(sum(sizes), pinned=cuda)
    bad: set[int] = set()

    def failed(k: int, exc: BaseException) -> None:
        bad.add(k)
        fail(k, exc)

    offsets = decompress_into(blobs, host.numpy(), failed)
    flat = host.to(device, non_blocking=cuda) if cuda else host.clone()  # one copy per batch
    if cuda:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        _local.event = event
    return [None if k in bad else flat[a : a + n] for k, (a, n) in enumerate(zip(offsets, sizes, strict=True))]


# -- nvCOMP on the device ----------------------------------------------------------------------------


def _codec(device: torch.device) -> Any:
    """This thread's nvCOMP codec for the current stream (a ``Codec`` must not be shared across threads)."""
    from nvidia import nvcomp

    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    codecs = getattr(_local, "codecs", None)
    if codecs is None:
        codecs = _local.codecs = {}
    if key not in codecs:
        codecs[key] = nvcomp.Codec(
            algorithm="LZ4", bitstream_kind=nvcomp.BitstreamKind.RAW, device_id=device.index or 0,
            cuda_stream=stream.cuda_stream,
        )  # fmt: skip
    return codecs[key]


def _nvcomp(blobs: Sequence[Any], device: torch.device, fail: Callable[[int, BaseException], None]) -> list[Any]:
    """The raw blocks (headers stripped) to the device in one copy, then one batched nvCOMP decode."""
    from nvidia import nvcomp

    blocks = [memoryview(b).cast("B")[LZ4_HEADER:] for b in blobs]
    lens = [len(b) for b in blocks]
    host = host_buffer(sum(lens), pinned=True)
    view, at = host.numpy(), 0
    for b, n in zip(blocks, lens, strict=True):
        view[at : at + n] = np.frombuffer(b, np.uint8)
        at += n
    flat = host.to(device, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    _local.event = event
    parts = torch.split(flat, lens)
    try:
        decoded = _codec(device).decode([nvcomp.as_array(p) for p in parts], "|u1")
    except RuntimeError:  # one bad block fails the call: python-lz4 names it
        return _cpu(blobs, device, fail)
    sizes = [max(lz4_size(b), 0) for b in blobs]
    out: list[Any] = []
    for k, (a, n) in enumerate(zip(decoded, sizes, strict=True)):
        t = torch.from_dlpack(a).view(torch.uint8).reshape(-1)
        if t.numel() != n:
            fail(k, DecodeError(f"nvCOMP: lz4 block decompressed to {t.numel()} bytes, its header says {n}"))
            out.append(None)
        else:
            out.append(t)
    return out


__all__ = ["NVCOMP_FROM", "choose", "decode_batch", "decompress_into", "host_buffer"]
