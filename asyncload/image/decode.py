"""The decode stage: a batch's stored image bytes and store-decoded arrays become its batch tensors.

Runs on the loop's CPU pool (``assembly``), one batch per call, many batches at once. For each sample it
decodes the stored bytes of image and mask columns (``codecs``: libjpeg-turbo, libspng, lz4, the GIL released)
and applies the sample's ``augment.Draw`` (OpenCV: crop, resize, flip, also GIL-free), writing straight
into the sample's row of the batch tensor, which is allocated once by ``collate``'s allocator (heap, or
a fan-out worker's shared memory). Without a crop, a decode writes into that row itself: no intermediate
array, no copy. With a crop, a JPEG whose crop shrinks a lot is decoded at 1/2, 1/4 or 1/8 scale into a
per-thread scratch buffer first.

An lz4 mask's bytes hold no shape: it takes its height and width from the image it is paired with (the
stage's ``pair``, the first image column, same row). A mask whose size does not match its image is read
again, decoded by the store, before the batch gets here: the pipeline hands each read to the stage's
``complete`` with a function that reads rows again through its own read path (``unpaired`` finds them).
The pipeline's byte budget asks the stage how large a read decodes (``decoded_ratio``): the pipeline
itself knows no codec.

A sample whose bytes do not decode is named (URL, column, row, the decoder's message) and raised as a
``ReadError``, or, with ``on_error="skip"``, left out of the batch and reported.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ..errors import CollateError, read_error
from ..runtime.alloc import allocate
from ..runtime.log import log_once
from .augment import Augment, Draw
from .codecs import DecodeError, Header, ImageColumn, Role, header, is_stored, lz4_header, lz4_size
from .codecs import decode as decode_bytes

#: What one read returns: column → one sample per index (stored bytes, or an array a store decoded).
Part = Mapping[str, Sequence[Any]]
#: ``read_again(positions, stored)``: the samples at ``positions`` of the read being completed, read again
#: with ``stored`` the columns returned as stored bytes. The pipeline's: it goes through the same request
#: gate, hedger and in-flight count as every other read.
ReadAgain = Callable[[list[int], frozenset[str]], Awaitable[Part]]


@dataclass(frozen=True)
class DecodeStage:
    """How one loader turns a batch's parts into its tensors; fixed for an epoch, pickled to workers."""

    columns: Mapping[str, ImageColumn]  # the image-like columns, with their roles
    encoded: frozenset[str]  # columns read as stored bytes and decoded here
    augment: Augment | None
    seed: int
    epoch: int = 0
    on_error: str = "raise"
    url: str = ""
    device: str | None = None  # "cuda[:N]": JPEG images decode on that GPU (``gpu``), the rest here
    ship: bool = False  # in a fan-out worker with a device: pack what was read for the parent (``gpu.pack``)
    pair: str | None = None  # the image column whose sizes lz4 masks take (their bytes hold none)

    @property
    def lz4(self) -> tuple[str, ...]:
        """The lz4 mask columns read as stored bytes (each decoded with its ``pair``'s size)."""
        return tuple(c for c in self.encoded if self.columns[c].stored == "lz4")

    ready: Any = None  # ``normalize.ModelReady``: the image columns made model-ready after decode and augment

    def for_epoch(self, epoch: int) -> DecodeStage:
        return replace(self, epoch=epoch)

    async def complete(self, part: Part, read_again: ReadAgain) -> Part:
        """One read (``part``) made decodable: an lz4 mask whose size is not its image's cannot be decoded
        from its bytes (which hold no shape), so those samples are read again with the mask column decoded
        by the store (a valid read, rare). Other reads come back as they are."""
        fix = unpaired(self, part) if self.lz4 else {}
        if not fix:
            return part
        out = dict(part)
        for c, ks in fix.items():
            again = await read_again(ks, self.encoded - {c})
            values = list(out[c])
            for j, k in enumerate(ks):
                values[k] = again[c][j]
            out[c] = values
        return out

    def decoded_ratio(self, part: Part) -> float:
        """Decoded bytes per byte read, guessed from a first read before any batch is assembled (for the
        pipeline's byte budget): the stored images' headers say how big they decode, an lz4 mask's first 4
        bytes too (or the augmentation's output size does); what the stage does not decode counts as read."""
        if not self.encoded:
            return 1.0
        out = self.augment.out_size if self.augment and self.augment.out_size else None
        read = decoded = 0
        for c, values in part.items():
            col = self.columns.get(c)
            for v in values:
                if col is None or not is_stored(v):
                    n = len(v) if is_stored(v) else int(getattr(v, "nbytes", 0))
                    read += n
                    decoded += n
                    continue
                read += len(v)
                if col.stored == "lz4":  # no header to read, and not an image format to sniff
                    pixels = out[0] * out[1] if out else max(lz4_size(v), 0)
                else:
                    try:
                        h = header(v)
                    except DecodeError:
                        continue
                    pixels = out[0] * out[1] if out else h.height * h.width
                decoded += pixels * (3 if col.role == "image" else 1)
        return max(1.0, decoded / read) if read else 1.0


class Failures:
    """The bad samples of one batch: ``fail(k, column, exc)`` raises a ``ReadError`` naming the URL,
    column and row, or, with ``on_error="skip"``, records sample ``k`` once (in ``bad`` and, with why, in
    ``skipped``)."""

    def __init__(self, stage: DecodeStage, rows: Sequence[int]) -> None:
        self.stage, self.rows = stage, rows
        self.bad: set[int] = set()
        self.skipped: list[tuple[int, str]] = []

    def __call__(self, k: int, col: str, exc: BaseException) -> None:
        if self.stage.on_error != "skip":
            raise read_error(self.stage.url, col, [self.rows[k]], exc) from exc
        if k not in self.bad:
            self.bad.add(k)
            self.skipped.append((self.rows[k], f"{type(exc).__name__} in column {col!r}: {exc}"))


_scratch = threading.local()


def _scratch_array(shape: tuple[int, ...]) -> np.ndarray:
    """A per-thread buffer of ``shape`` (uint8), reused across samples: a cropped sample decodes here."""
    n = int(np.prod(shape))
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < n:
        buf = _scratch.buf = np.empty(max(n, 1 << 20), np.uint8)
    return buf[:n].reshape(shape)


def run(
    stage: DecodeStage,
    cols: Sequence[str],
    values: Mapping[str, Sequence[Any]],
    rows: Sequence[int],
    walls: list[float] | None = None,
) -> tuple[dict[str, Any], list[int], list[tuple[int, str]]]:
    """Decode and augment one batch. ``values[col][k]``: sample ``k``'s stored bytes (``encoded`` columns)
    or array. Returns, per image-like column, a batch tensor of the good samples or, where their sizes
    differ, a list of their arrays (for ``collate`` to stack, pad, list or refuse); the positions ``k`` of
    the good samples; and the skipped samples (row, why). ``walls``, when given: the wall seconds of the
    augmentation are added to ``walls[1]`` (two clock reads per augmented sample)."""
    n = len(rows)
    image_cols = [c for c in cols if c in stage.columns]
    heads: dict[str, list[Header | None]] = {}
    fail = Failures(stage, rows)
    bad, skipped = fail.bad, fail.skipped

    lz4 = [c for c in image_cols if stage.columns[c].stored == "lz4"]
    for c in sorted(image_cols, key=lambda c: c in lz4):  # what each sample is, before any pixel is decoded
        hs: list[Header | None] = []
        for k, v in enumerate(values[c]):
            try:
                if not is_stored(v):
                    _as_hw(v, stage.columns[c])
                    hs.append(None)
                elif c in lz4:  # no shape in its bytes: the paired image's (a bad image fails its row first)
                    hs.append(None if k in bad else lz4_header(v, *_pair_size(stage, values, heads, k)))
                else:
                    hs.append(header(v))
            except DecodeError as exc:
                fail(k, c, exc)
                hs.append(None)
        heads[c] = hs

    def size(c: str, k: int) -> tuple[int, int]:
        h = heads[c][k]
        if h is not None:
            return (h.height, h.width)
        return tuple(np.shape(values[c][k])[:2]) if k not in bad else (1, 1)  # type: ignore[return-value]

    draws: list[Draw] | None = None
    aug = stage.augment
    if aug is not None and image_cols:
        first = image_cols[0]
        sizes = [size(first, k) for k in range(n)]
        for c in image_cols[1:]:
            for k in range(n):
                if k not in bad and size(c, k) != sizes[k]:  # a data error of that row: raised, or skipped
                    fail(k, c, unequal_sizes(c, size(c, k), first, sizes[k]))
        draws = aug.draws(stage.seed, stage.epoch, rows, sizes)

    good = [k for k in range(n) if k not in bad]
    fixed = aug.out_size if aug is not None and draws is not None else None
    dest: dict[str, torch.Tensor | None] = {}
    for c in image_cols:
        tail = (3,) if stage.columns[c].role == "image" else ()
        shapes = {(*fixed, *tail)} if fixed else {_shape(c, k, heads, values, stage.columns[c]) for k in good}
        dest[c] = allocate((len(good), *shapes.pop()), torch.uint8) if len(shapes) == 1 else None
    views = {c: t.numpy() for c, t in dest.items() if t is not None}
    lists: dict[str, list[np.ndarray]] = {c: [] for c, t in dest.items() if t is None}
    keep: list[int] = []
    augmented = 0.0  # wall seconds applying the draws
    for k in good:  # sample by sample, every column: a sample that fails leaves no row behind
        r = len(keep)
        pending: dict[str, np.ndarray] = {}
        try:
            for c in image_cols:
                col = stage.columns[c]
                target = views[c][r] if c in views else None
                if fixed is not None and target is not None and draws is not None and aug is not None:
                    fill = aug.fills[0] if col.role == "image" else aug.fills[1]
                    head = heads[c][k]
                    if head is not None:
                        augmented += _decode_drawn(values[c][k], head, col, draws[k], target, fill, aug)
                    else:
                        t = time.perf_counter()
                        apply(_as_hw(values[c][k], col), target, draws[k], col.role, fill, aug.interpolation)
                        augmented += time.perf_counter() - t
                    continue
                if heads[c][k] is not None:
                    arr = decode_bytes(values[c][k], col.mode, target, head=heads[c][k])
                else:
                    arr = _as_hw(values[c][k], col)
                    if target is not None:
                        target[...] = arr
                        arr = target
                if draws is not None and draws[k].flip:
                    t = time.perf_counter()
                    arr = arr[:, ::-1].copy() if target is None else _flip_in_place(target)
                    augmented += time.perf_counter() - t
                if target is None:
                    pending[c] = arr
        except DecodeError as exc:
            fail(k, c, exc)
            continue
        for c, arr in pending.items():
            lists[c].append(arr)
        keep.append(k)
    tensors: dict[str, Any] = {}
    for c in image_cols:
        t = dest[c]
        if t is not None:
            tensors[c] = t if len(keep) == len(t) else t[: len(keep)]
        else:  # samples of unequal sizes: collated (stacked, padded, listed or refused) with the other columns
            tensors[c] = lists[c]
    if walls is not None:
        walls[1] += augmented
    return tensors, keep, skipped


def unequal_sizes(col: str, got: tuple[int, ...], first: str, want: tuple[int, ...], where: str = "") -> CollateError:
    """The error of a row whose column ``col`` is not the size of its ``first`` image column, which paired
    augmentation needs (one crop for both): built here for the CPU stage and the device stage (``gpu``)
    alike. ``where``: what precedes the message (the device stage names the row and URL itself)."""
    return CollateError(
        f"{where}column {col!r} is {got[0]}x{got[1]} but {first!r} is {want[0]}x{want[1]}; "
        "paired augmentation needs them equal"
    )


def _pair_size(
    stage: DecodeStage, values: Mapping[str, Sequence[Any]], heads: Mapping[str, list[Header | None]], k: int
) -> tuple[int, int]:
    """Height and width of sample ``k``'s paired image: its header, or the array the store decoded."""
    pair = stage.pair
    if pair is None or pair not in values:
        raise DecodeError("an lz4 mask needs an image column to take its size from, and the batch has none")
    h = heads.get(pair, [None] * (k + 1))[k]
    if h is not None:
        return h.height, h.width
    v = values[pair][k]
    if is_stored(v):
        h = header(v)
        return h.height, h.width
    return tuple(np.shape(v)[:2])  # type: ignore[return-value]


def unpaired(stage: DecodeStage, part: Mapping[str, Sequence[Any]]) -> dict[str, list[int]]:
    """Per lz4 mask column of one read (``part``: column → samples), the positions whose blob's size is
    not its paired image's height × width: those must be decoded by the store, whose metadata knows their
    shape. Header reads only (microseconds a sample); an image whose header is bad is left to the stage,
    which names it."""
    out: dict[str, list[int]] = {}
    if stage.pair is None or stage.pair not in part:
        return out
    images = part[stage.pair]
    for c in stage.lz4:
        if c not in part:
            continue
        bad = []
        for k, (img, m) in enumerate(zip(images, part[c], strict=True)):
            if not is_stored(m):
                continue
            try:
                h = header(img) if is_stored(img) else None
                hw = (h.height, h.width) if h is not None else tuple(np.shape(img)[:2])
            except DecodeError:
                continue
            if lz4_size(m) != hw[0] * hw[1]:
                bad.append(k)
                log_once(
                    f"asyncload: {stage.url}: lz4 mask column {c!r} has masks whose size is not their image's "
                    f"({lz4_size(m)} bytes against {stage.pair!r}'s {hw[0]}x{hw[1]}); the store decodes those masks"
                )
        if bad:
            out[c] = bad
    return out


def _flip_in_place(a: np.ndarray) -> np.ndarray:
    import cv2

    cv2.flip(a, 1, dst=a)
    return a


def _shape(
    c: str, k: int, heads: Mapping[str, list[Header | None]], values: Mapping[str, Any], col: ImageColumn
) -> tuple[int, ...]:
    h = heads[c][k]
    if h is not None:
        return (h.height, h.width, 3) if col.role == "image" else (h.height, h.width)
    return tuple(_as_hw(values[c][k], col).shape)


def _as_hw(arr: Any, col: ImageColumn) -> np.ndarray:
    """A mask as ``H×W`` whatever its store returned (Deep Lake gives PNG masks a trailing axis of 1).
    An image the store decoded to no pixels is an error of that sample, not a shape to collate: Deep Lake
    returns shape ``()`` for bytes it cannot decode."""
    arr = np.asarray(arr)
    if arr.ndim < 2 or 0 in arr.shape:
        raise DecodeError(f"the store decoded it to an array of shape {arr.shape}: its stored bytes are not an image")
    if col.role == "mask" and arr.ndim == 3 and arr.shape[2] == 1:
        return arr[..., 0]
    return arr


def _decode_drawn(
    data: Any, head: Header, col: ImageColumn, d: Draw, dst: np.ndarray, fill: int, aug: Augment
) -> float:
    """Decode one sample (at reduced scale where the crop shrinks enough) and apply ``d`` into ``dst``;
    returns the wall seconds of applying it."""
    reduce = 1
    if head.format == "jpeg":
        _, _, bh, bw = d.box
        _, _, ih, iw = d.inner
        for f in (8, 4, 2):
            if bh >= f * ih and bw >= f * iw:
                reduce = f
                break
    h, w = -(-head.height // reduce), -(-head.width // reduce)
    scratch = _scratch_array((h, w, 3) if col.role == "image" else (h, w))
    img = decode_bytes(data, col.mode, scratch, reduce=reduce, head=head)
    if img.shape[:2] != (head.height, head.width):
        d = _scaled(d, img.shape[0] / head.height, img.shape[1] / head.width)
    t = time.perf_counter()
    apply(img, dst, d, col.role, fill, aug.interpolation)
    return time.perf_counter() - t


def _scaled(d: Draw, sy: float, sx: float) -> Draw:
    y, x, h, w = d.box
    y2, x2 = round(y * sy), round(x * sx)
    return Draw((y2, x2, max(1, round((y + h) * sy) - y2), max(1, round((x + w) * sx) - x2)), d.out, d.inner, d.flip)


def apply(src: np.ndarray, dst: np.ndarray, d: Draw, role: Role, fill: int, interpolation: str = "auto") -> None:
    """Crop ``src`` to ``d.box``, resize into ``d.inner`` of ``dst`` (the rest filled with ``fill``), and
    mirror it if ``d.flip``: nearest for masks, so that class ids stay class ids; for images, with
    ``interpolation="auto"``, area averaging where a side shrinks 2x or more and bilinear below that
    (a JPEG decoded at 1/2, 1/4 or 1/8 scale has had the larger part of its shrink done by the scaled
    IDCT, itself an averaging filter; area costs ~9x bilinear at the factors between)."""
    import cv2

    y, x, h, w = d.box
    crop = src[y : y + h, x : x + w]
    top, left, ih, iw = d.inner
    if (ih, iw) != dst.shape[:2]:
        dst[...] = fill
    region = dst[top : top + ih, left : left + iw]
    if role == "mask":
        mode = cv2.INTER_NEAREST_EXACT
    elif interpolation == "area" or (interpolation == "auto" and (h >= 2 * ih or w >= 2 * iw)):
        mode = cv2.INTER_AREA  # averages every source pixel: antialiased, and ~9x bilinear's cost
    else:
        mode = cv2.INTER_LINEAR
    if (ih, iw) == (h, w):
        region[...] = crop
    else:
        got = cv2.resize(crop, (iw, ih), dst=region, interpolation=mode)
        if not np.shares_memory(got, region):  # OpenCV made its own array: never expected, but never lost
            region[...] = got.reshape(region.shape)
    if d.flip:
        cv2.flip(region, 1, dst=region)


def decoders_available() -> str | None:
    """None when the native decoders are installed, else what is missing (``decode="auto"`` then lets the
    store decode). imagecodecs (libspng) is optional: OpenCV's libpng decodes PNG without it.

    OpenCV is looked up, not imported: it is needed only for crops, resizes, flips, the CPU normalize and
    PNGs libspng does not take, and its import costs ~0.1-0.2 s of CPU (its own OpenBLAS starts a thread
    per core that spins), a tenth of a 1,000-row PNG epoch's client CPU on 2 cores. Where it is used, it
    is imported then."""
    missing = []
    for mod in ("simplejpeg", "lz4.block"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod.split(".")[0])
    if importlib.util.find_spec("cv2") is None:
        missing.append("cv2")
    return ", ".join(missing) or None


def decode_stage(source: Any, options: Any) -> DecodeStage | None:
    """The stage a loader with ``options`` runs for ``source`` (open), or None when no column needs one.

    ``decode="auto"`` (and "cpu", "cuda"): every column whose stored codec asyncload decodes is read as
    stored bytes and decoded here, Deep Lake's included: it costs less CPU than the store's decode and its
    reads are smaller (benchmarks/results/decode.md). PNG too, measured again with the reader process:
    ``decode="store"`` (Deep Lake decodes in the reader's native threads, and the pixels, 2.2x the stored
    bytes, cross to this process) cost 1.25x the CPU per sample of the process tree on local disk and 1.29x
    at 50 ms (packet-level), 1,000 photo-like 256x256 PNG rows with lz4 masks; for JPEG 2.25x and 2.56x
    (benchmarks/results/cpu/).
    lz4 masks need an image column of the same loader to take their size from; without one, the store
    decodes them, and the log says so once."""
    from ..errors import ConfigError

    cols = dict(source.image_columns())
    aug: Augment | None = options.augment
    if aug is not None and not cols:
        raise ConfigError(
            f"augment={list(aug.ops)!r} is not allowed for {source.url}: none of the columns "
            f"{', '.join(source.columns)} is an image or a mask"
        )
    ready = options.model_ready
    if ready is not None and not any(col.role == "image" for col in cols.values()):
        raise ConfigError(
            f"normalize={options.normalize!r}, layout={options.layout!r}, dtype={options.dtype!r} are not allowed "
            f"for {source.url}: none of the columns {', '.join(source.columns)} is an image"
        )
    if not cols:
        return None
    mode = options.decode
    device = mode if mode.startswith("cuda") else None
    missing = decoders_available() if mode == "auto" else None
    if missing:
        log_once(f"asyncload: {missing} not importable; the store decodes images (decode='store')")
    if mode == "store" or missing:
        encoded: frozenset[str] = frozenset()
    else:
        encoded = frozenset(c for c, col in cols.items() if col.stored and col.stored != "lz4")
    pair = next((c for c in source.columns if c in encoded and cols[c].role == "image"), None)
    lz4 = [c for c, col in cols.items() if col.stored == "lz4"]
    if lz4 and mode != "store" and not missing:
        if pair is None:
            log_once(
                f"asyncload: {source.url}: the store decodes lz4 mask column(s) {', '.join(map(repr, lz4))}: "
                "an lz4 blob holds no shape, and no image column read here gives one"
            )
        else:
            encoded |= frozenset(lz4)
    return DecodeStage(
        cols,
        encoded,
        aug,
        seed=int(options.seed),
        on_error=options.on_error,
        url=source.url,
        device=device,
        pair=pair,
        ready=ready,
    )


__all__ = [
    "Failures", "ImageColumn", "Part", "ReadAgain", "Role", "DecodeStage", "apply", "decode_stage", "decoders_available",
    "run", "unequal_sizes", "unpaired",
]  # fmt: skip
