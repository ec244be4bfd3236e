"""The decode stage on a GPU (``decode="cuda"``): JPEG images decoded by nvJPEG in one batched call, the
batch's crop, resize and flip run on the device, and the batch delivered in device memory.

The CPU only fetches bytes. What nvJPEG is not given falls back to the CPU decoders (``codecs``), said
once in the log: PNG and other codecs, masks (class ids are not images; they are decoded on the CPU and
copied, a small fraction of the bytes), and JPEG bytes that do not end with the EOI marker (a file cut
short, which libjpeg-turbo's strict mode rejects with a message, where a GPU decoder may return grey).

Geometry matches the CPU stage's draws exactly (the same ``augment.Draw``); pixels differ from the CPU
path by interpolation rounding only: antialiased bilinear here where the CPU averages areas.

With worker processes (``processes=K``), workers must not touch the GPU: they ``pack`` the stage's
columns as they were read (stored bytes, store-decoded masks) into shared-memory tensors, and the training
process runs ``finish`` (``unpack``, then ``run``) on each batch it receives, several batches at once on
its device threads (``processes.fanout.iterator``). The draws depend on (seed, epoch, row) only, so the batch is the
one a single process would make.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError
from ..runtime.alloc import allocate
from ..runtime.log import log_once
from .augment import Draw
from .codecs import DecodeError, is_stored, sniff
from .codecs import decode as decode_bytes
from .decode import DecodeStage, Failures, ImageColumn, _as_hw, unequal_sizes
from .normalize import image_columns

#: What ``decode="cuda"`` without torchvision says: nvJPEG is reached through torchvision, which asyncload
#: does not require (a CPU install would pull a CUDA build of it), so the ``gpu`` extra names it.
NEEDS_TORCHVISION = (
    "decode={decode!r} needs torchvision (nvJPEG is called through torchvision.io.decode_jpeg), which is not "
    "installed: pip install 'torch-asyncload[gpu]', or the torchvision build that matches your torch"
)


def has_torchvision() -> bool:
    """Whether torchvision can be imported, without importing it (a second or two)."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"] is not None
    return importlib.util.find_spec("torchvision") is not None


def require_torchvision(decode: str) -> None:
    """Raise ``ConfigError`` naming the ``gpu`` extra for ``decode="cuda"`` (or "cuda:N") without
    torchvision: where the loader is built, not as a bare ``ModuleNotFoundError`` at the first batch."""
    if decode.startswith("cuda") and not has_torchvision():
        raise ConfigError(NEEDS_TORCHVISION.format(decode=decode))


#: The batch key that lists the columns a fan-out worker shipped undecoded (see ``pack``).
PACKED = "_asyncload_packed"
_EOI = b"\xff\xd9"


def run(
    stage: DecodeStage, cols: Sequence[str], values: Mapping[str, Sequence[Any]], rows: Sequence[int]
) -> tuple[dict[str, Any], list[int], list[tuple[int, str]]]:
    """Like ``decode.run``, with the image-like columns' tensors on ``stage.device``."""
    device = torch.device(stage.device or "cuda")
    n = len(rows)
    image_cols = [c for c in cols if c in stage.columns]
    fail = Failures(stage, rows)
    bad, skipped = fail.bad, fail.skipped

    pixels: dict[str, list[torch.Tensor | None]] = {}  # per column, each sample as C×H×W on the device
    lz4 = [c for c in image_cols if stage.columns[c].stored == "lz4" and c in stage.encoded]
    for c in image_cols:
        if c not in lz4:
            pixels[c] = _decode_column(c, stage.columns[c], values[c], device, fail)
    for c in lz4:  # Deep Lake's lz4 masks: the size of their images (``lz4masks``)
        pixels[c] = _lz4_column(c, values[c], pixels, image_cols, device, fail)
    good = [k for k in range(n) if k not in bad]
    sizes = [tuple(pixels[image_cols[0]][k].shape[1:]) for k in good] if image_cols else []  # type: ignore[union-attr]
    for c in image_cols[1:]:
        for k, s in zip(good, sizes, strict=True):
            got = tuple(pixels[c][k].shape[1:])  # type: ignore[union-attr]
            if stage.augment is not None and got != s:
                raise unequal_sizes(c, got, image_cols[0], s, where=f"row {rows[k]} of {stage.url}: ")
    aug = stage.augment
    draws = aug.draws(stage.seed, stage.epoch, [rows[k] for k in good], sizes) if aug is not None else None
    tensors: dict[str, Any] = {}
    for c in image_cols:
        role = stage.columns[c].role
        items = [pixels[c][k] for k in good]
        if draws is not None and aug is not None and aug.out_size is not None:
            fill = aug.fills[0] if role == "image" else aug.fills[1]
            channels = (3,) if role == "image" else ()
            out = torch.empty((len(good), *aug.out_size, *channels), dtype=torch.uint8, device=device)
            for j, (img, d) in enumerate(zip(items, draws, strict=True)):
                place(img, d, role, out[j], fill, aug.interpolation)  # type: ignore[arg-type]
            tensors[c] = out
            continue
        if draws is not None:
            items = [img.flip(-1) if d.flip else img for img, d in zip(items, draws, strict=True)]  # type: ignore[union-attr]
        if items and all(t.shape == items[0].shape for t in items):  # type: ignore[union-attr]
            stacked = torch.stack(items)  # type: ignore[arg-type]
            tensors[c] = stacked.permute(0, 2, 3, 1).contiguous() if role == "image" else stacked[:, 0]
        else:
            tensors[c] = [(t.permute(1, 2, 0) if role == "image" else t[0]).contiguous() for t in items]  # type: ignore[union-attr]
    return tensors, good, skipped


def _decode_column(
    c: str, col: ImageColumn, values: Sequence[Any], device: torch.device, fail: Any
) -> list[torch.Tensor | None]:
    """Each sample of one column as a C×H×W uint8 tensor on ``device`` (None where it failed).

    Per batch, not per sample: the JPEGs go to nvJPEG in one call (from one buffer), and what the CPU
    decodes goes to the device in one copy, each sample a view of it. Per-sample copies and Python work
    were what bounded the first GPU run (benchmarks/results/gpu_decode/)."""
    out: list[torch.Tensor | None] = [None] * len(values)
    on_gpu = device.type == "cuda" and col.role == "image"
    gpu_k = [k for k, v in enumerate(values) if on_gpu and is_stored(v) and v[:3] == b"\xff\xd8\xff" and v[-2:] == _EOI]
    if gpu_k:
        require_torchvision(str(device))  # a loader checks as it is built; this is for other callers
        from torchvision.io import ImageReadMode, decode_jpeg

        data = [t for t in _split(_flat([values[k] for k in gpu_k]), [len(values[k]) for k in gpu_k])]
        try:
            decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one bad sample fails the call: find it
            decoded = []
            for k, d in zip(gpu_k, data, strict=True):
                try:
                    decoded.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=device))
                except RuntimeError as exc:
                    fail(k, c, DecodeError(f"nvJPEG: {exc}"))
                    decoded.append(None)
        for k, img in zip(gpu_k, decoded, strict=True):
            out[k] = img
    done = set(gpu_k)
    here: dict[int, np.ndarray] = {}
    for k, v in enumerate(values):
        if k in done:
            continue
        try:
            if is_stored(v):
                if col.role == "image":
                    log_once(f"asyncload: column {c!r}: {sniff(v)} images decode on the CPU (nvJPEG takes whole JPEGs)")
                here[k] = decode_bytes(v, col.mode)
            else:
                here[k] = _as_hw(v, col)
        except DecodeError as exc:
            fail(k, c, exc)
    if here:
        arrays = list(here.values())
        flat = _flat(arrays).to(device, non_blocking=False)
        for k, a, t in zip(here, arrays, _split(flat, [a.size for a in arrays]), strict=True):
            t = t.view(a.shape)
            out[k] = t.permute(2, 0, 1) if t.ndim == 3 else t[None]
    return out


def _lz4_column(
    c: str, blobs: Sequence[Any], pixels: Mapping[str, list[torch.Tensor | None]], image_cols: Sequence[str],
    device: torch.device, fail: Any,
) -> list[torch.Tensor | None]:  # fmt: skip
    """One column of lz4 mask blobs decompressed per batch (``lz4masks``: nvCOMP or python-lz4 into pinned
    memory, chosen by batch), each the height and width of the row's image in the first decoded column."""
    from .lz4masks import decode_batch

    paired = next(pixels[p] for p in image_cols if p in pixels)
    shapes = [tuple(t.shape[-2:]) if t is not None else None for t in paired]
    return decode_batch(blobs, shapes, device, lambda k, exc: fail(k, c, exc))  # type: ignore[arg-type]


def _flat(items: Sequence[Any]) -> torch.Tensor:
    """Bytes or arrays, one after another in one new CPU tensor (one copy each, no Python per byte)."""
    sizes = [len(v) if is_stored(v) else v.size for v in items]
    buf = torch.empty(sum(sizes), dtype=torch.uint8)
    view, at = buf.numpy(), 0
    for v, n in zip(items, sizes, strict=True):
        view[at : at + n] = np.frombuffer(v, np.uint8) if is_stored(v) else v.reshape(-1)
        at += n
    return buf


def _split(flat: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    return list(torch.split(flat, list(sizes)))


def place(img: torch.Tensor, d: Draw, role: str, dst: torch.Tensor, fill: int, interpolation: str = "auto") -> None:
    """Crop ``img`` (C×H×W) to ``d.box``, resize into ``d.inner`` of ``dst`` (H×W×C or H×W, the rest
    ``fill``), mirrored if ``d.flip``: the device twin of ``decode.apply`` (antialiased bilinear for images
    when shrinking, nearest for masks)."""
    import torch.nn.functional as F

    y, x, h, w = d.box
    top, left, ih, iw = d.inner
    crop = img[:, y : y + h, x : x + w][None].float()
    if role == "mask":
        out = F.interpolate(crop, size=(ih, iw), mode="nearest-exact")
    else:
        shrink = ih < h or iw < w
        aa = shrink and interpolation != "bilinear"
        out = F.interpolate(crop, size=(ih, iw), mode="bilinear", align_corners=False, antialias=aa)
        out = out.round_().clamp_(0, 255)
    if d.flip:
        out = out.flip(-1)
    if (ih, iw) != tuple(dst.shape[:2]):
        dst.fill_(fill)
    region = dst[top : top + ih, left : left + iw]
    region.copy_(out[0].permute(1, 2, 0) if dst.ndim == 3 else out[0, 0])


# -- fan-out: workers ship what they read, the training process decodes ------------------------------


def pack(
    stage: DecodeStage, cols: Sequence[str], values: Mapping[str, Sequence[Any]], rows: Sequence[int]
) -> dict[str, Any]:
    """The stage's columns as read, in three tensors each (allocated where batches go: a fan-out
    worker's shared memory): ``data`` (every sample's bytes, one after another), ``spans`` (start, end)
    and ``shapes`` (an array's shape; -1 for stored bytes). Plus the rows, which the draws need."""
    out: dict[str, Any] = {PACKED: [c for c in cols if c in stage.columns], f"{PACKED}_rows": torch.tensor(list(rows))}
    for c in out[PACKED]:
        blobs = [memoryview(v).cast("B") if is_stored(v) else np.ascontiguousarray(v).reshape(-1) for v in values[c]]
        lens = [len(b) for b in blobs]
        data = allocate((sum(lens),), torch.uint8)
        view, at, spans, shapes = data.numpy(), 0, [], []
        for v, b, n in zip(values[c], blobs, lens, strict=True):
            view[at : at + n] = np.frombuffer(b, np.uint8) if is_stored(v) else b.view(np.uint8)
            spans.append((at, at + n))
            shapes.append((-1, -1, -1) if is_stored(v) else (*np.shape(v), *([1] * (3 - np.ndim(v))))[:3])
            at += n
        out[c] = {"data": data, "spans": torch.tensor(spans, dtype=torch.int64).reshape(-1, 2),
                  "shapes": torch.tensor(shapes, dtype=torch.int64).reshape(-1, 3), "ndim": [np.ndim(v) for v in values[c]]}  # fmt: skip
    return out


def unpack(batch: dict[str, Any]) -> tuple[list[str], dict[str, list[Any]], list[int]]:
    """``pack``'s columns back as values ``run`` takes (bytes, or arrays), and the rows."""
    cols: list[str] = batch.pop(PACKED)
    rows = batch.pop(f"{PACKED}_rows").tolist()
    values: dict[str, list[Any]] = {}
    for c in cols:
        p = batch.pop(c)
        data = p["data"].numpy()
        vals: list[Any] = []
        for (a, b), shape, nd in zip(p["spans"].tolist(), p["shapes"].tolist(), p["ndim"], strict=True):
            vals.append(data[a:b].tobytes() if shape[0] < 0 else data[a:b].reshape(shape[:nd]))
        values[c] = vals
    return cols, values, rows


def finish(stage: DecodeStage, batch: dict[str, Any], with_index: bool) -> tuple[dict[str, Any], list[tuple[int, str]]]:
    """A fan-out worker's packed batch made whole in the training process: the stage's columns decoded
    and augmented on the device, the other columns (already collated by the worker) kept for the samples
    that decoded. Returns the batch and the samples skipped here. Thread-safe: the fan-out's epoch runs it
    on several device threads at once, as one process runs ``run`` on its CPU pool (``lz4masks`` keeps its
    staging buffers per thread)."""
    cols, values, rows = unpack(batch)
    tensors, keep, skipped = run(stage, cols, values, rows)
    if len(keep) != len(rows):
        for k, v in list(batch.items()):
            if isinstance(v, torch.Tensor) and v.shape[:1] == (len(rows),):
                batch[k] = v[keep]
            elif isinstance(v, list) and len(v) == len(rows):
                batch[k] = [v[j] for j in keep]
    out = {c: tensors[c] for c in cols if c in tensors}
    out.update(batch)
    if stage.ready is not None:  # model-ready on the device: one gather per image column after the geometry
        out = stage.ready.batch(out, image_columns(stage.columns))
    return out, skipped


__all__ = ["PACKED", "finish", "pack", "place", "run", "unpack"]
