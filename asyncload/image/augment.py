"""Paired geometric augmentation: resize, random resized crop and horizontal flip, drawn once per sample
and applied alike to an image and its masks.

The ops are small frozen values in the spirit of torchvision's v2 transforms, given to the loader as a
list (``augment=[RandomResizedCrop(256), RandomHorizontalFlip()]``). They are not callables: the loader
compiles the list into one ``Augment`` that, per sample, draws one ``Draw`` (a crop box in the stored
image, where it lands in the output, whether it is mirrored) and the decode stage applies it with native
code, the GIL released, straight into the batch tensor (``decode``), or on the GPU (``gpu``).

Why the randomness is a hash of (seed, epoch, row) and not a generator's stream: the draw of a row must
not depend on which process reads it, in what order, or whether the epoch was resumed halfway, so that
one process, worker processes, DataLoader workers and ranks all produce the same augmented epoch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ..runtime.settings import check

Size = int | tuple[int, int]
#: ``auto``: area averaging where a side shrinks 2x or more (after a JPEG's scaled decode, which does the
#: power-of-two part of a shrink), bilinear otherwise; ``area`` averages at any shrink (slower).
Interpolation = Literal["auto", "bilinear", "area"]
_INTERPOLATIONS = ("auto", "bilinear", "area")


def _size(name: str, size: Size) -> tuple[int, int]:
    if isinstance(size, int) and not isinstance(size, bool):
        size = (size, size)
    ok = isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(v, int) and v >= 1 for v in size)
    check(f"{name}.size", size, ok, "an int >= 1 or (height, width)")
    return int(size[0]), int(size[1])


def _range(name: str, value: tuple[float, float], low: float) -> tuple[float, float]:
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and low < float(value[0]) <= float(value[1])
    check(name, value, ok, f"(min, max) with {low} < min <= max")
    return float(value[0]), float(value[1])


@dataclass(frozen=True)
class Resize:
    """Resize the whole image to ``size`` (an int: square; or ``(height, width)``).

    ``keep_aspect=False`` stretches. ``True`` scales to fit inside ``size`` and pads the rest: images with
    ``fill``, masks with ``mask_fill`` (255, the usual ignore index, so the loss skips padding)."""

    size: Size
    keep_aspect: bool = False
    fill: int = 0
    mask_fill: int = 255
    interpolation: Interpolation = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size("Resize", self.size))
        check("Resize.fill", self.fill, 0 <= self.fill <= 255, "an int in [0, 255]")
        check("Resize.mask_fill", self.mask_fill, 0 <= self.mask_fill <= 255, "an int in [0, 255]")
        check(
            "Resize.interpolation",
            self.interpolation,
            self.interpolation in _INTERPOLATIONS,
            "'auto', 'bilinear' or 'area'",
        )


@dataclass(frozen=True)
class RandomResizedCrop:
    """A random crop of ``scale`` × the image's area and aspect ratio in ``ratio`` (log-uniform), resized
    to ``size``: the usual segmentation recipe (torchvision's ``RandomResizedCrop`` draws the same way)."""

    size: Size
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    interpolation: Interpolation = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "size", _size("RandomResizedCrop", self.size))
        object.__setattr__(self, "scale", _range("RandomResizedCrop.scale", self.scale, 0.0))
        object.__setattr__(self, "ratio", _range("RandomResizedCrop.ratio", self.ratio, 0.0))
        check("RandomResizedCrop.scale", self.scale, self.scale[1] <= 1.0, "(min, max) with 0 < min <= max <= 1")
        ok = self.interpolation in _INTERPOLATIONS
        check("RandomResizedCrop.interpolation", self.interpolation, ok, "'auto', 'bilinear' or 'area'")


@dataclass(frozen=True)
class RandomHorizontalFlip:
    """Mirror left to right with probability ``p``."""

    p: float = 0.5

    def __post_init__(self) -> None:
        check("RandomHorizontalFlip.p", self.p, 0.0 <= self.p <= 1.0, "a number in [0, 1]")


Op = Resize | RandomResizedCrop | RandomHorizontalFlip


@dataclass(frozen=True)
class Draw:
    """One sample's geometry. ``box`` (y, x, h, w): the stored pixels used; ``inner`` (y, x, h, w): where
    they land in the ``out``-sized result (all of it unless padded); ``flip``: mirrored left to right."""

    box: tuple[int, int, int, int]
    out: tuple[int, int]
    inner: tuple[int, int, int, int]
    flip: bool


_ATTEMPTS = 10  # crop draws tried before the centre-crop fallback, as torchvision does


class Augment:
    """A validated list of ops, compiled: at most one sizing op (``Resize`` or ``RandomResizedCrop``) and
    any number of flips, before or after it."""

    def __init__(self, ops: Sequence[Op] | Op) -> None:
        ops = [ops] if isinstance(ops, (Resize, RandomResizedCrop, RandomHorizontalFlip)) else list(ops)
        for op in ops:
            check("augment", op, isinstance(op, (Resize, RandomResizedCrop, RandomHorizontalFlip)),
                  "a list of Resize, RandomResizedCrop and RandomHorizontalFlip")  # fmt: skip
        sizing = [k for k, op in enumerate(ops) if isinstance(op, (Resize, RandomResizedCrop))]
        check("augment", ops, len(sizing) <= 1, "at most one Resize or RandomResizedCrop")
        self.ops: tuple[Op, ...] = tuple(ops)
        self.sizing: Resize | RandomResizedCrop | None = ops[sizing[0]] if sizing else None  # type: ignore[assignment]
        at = sizing[0] if sizing else len(ops)
        self._flips_before = [op.p for op in ops[:at] if isinstance(op, RandomHorizontalFlip)]
        self._flips_after = [op.p for op in ops[at:] if isinstance(op, RandomHorizontalFlip)]

    def __repr__(self) -> str:
        return f"Augment({list(self.ops)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Augment) and other.ops == self.ops

    def __hash__(self) -> int:
        return hash(self.ops)

    @property
    def out_size(self) -> tuple[int, int] | None:
        """The (height, width) every sample comes out at, or None (flips only: the stored size)."""
        return self.sizing.size if self.sizing is not None else None  # type: ignore[return-value]

    @property
    def fills(self) -> tuple[int, int]:
        """Padding values (image, mask)."""
        s = self.sizing
        return (s.fill, s.mask_fill) if isinstance(s, Resize) else (0, 255)

    @property
    def interpolation(self) -> Interpolation:
        return self.sizing.interpolation if self.sizing is not None else "auto"

    def draws(self, seed: int, epoch: int, rows: Sequence[int], sizes: Sequence[tuple[int, int]]) -> list[Draw]:
        """The geometry of each of ``rows`` (dataset row ids) whose stored images are ``sizes`` (h, w)."""
        flips = len(self._flips_before) + len(self._flips_after)
        u = uniforms(seed, epoch, rows, 2 * _ATTEMPTS + 2 + flips)
        p = np.array(self._flips_before + self._flips_after)
        flip_draws = u[:, 2 * _ATTEMPTS + 2 :] < p if flips else np.zeros((len(rows), 0), bool)
        nb = len(self._flips_before)
        out: list[Draw] = []
        for k, (h, w) in enumerate(sizes):
            before = bool(flip_draws[k, :nb].sum() % 2)
            after = bool(flip_draws[k, nb:].sum() % 2)
            out.append(self._draw(h, w, u[k], before, after))
        return out

    def _draw(self, h: int, w: int, u: np.ndarray, before: bool, after: bool) -> Draw:
        s = self.sizing
        box = (0, 0, h, w)
        if isinstance(s, RandomResizedCrop):
            box = _crop_box(h, w, s.scale, s.ratio, u)
        if before:  # a flip ahead of the crop: the same pixels as mirroring the crop of the mirrored box
            y, x, bh, bw = box
            box = (y, w - x - bw, bh, bw)
        out = self.out_size or (h, w)
        inner = (0, 0, *out)
        if isinstance(s, Resize) and s.keep_aspect:
            scale = min(out[0] / h, out[1] / w)
            ih, iw = max(1, min(out[0], round(h * scale))), max(1, min(out[1], round(w * scale)))
            inner = ((out[0] - ih) // 2, (out[1] - iw) // 2, ih, iw)
            if after:  # the padding mirrors with the content
                inner = (inner[0], out[1] - inner[1] - iw, ih, iw)
        return Draw(box, out, inner, before != after)


def _crop_box(
    h: int, w: int, scale: tuple[float, float], ratio: tuple[float, float], u: np.ndarray
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop draw, fed by ``u`` (2 × attempts + 2 uniforms in [0, 1))."""
    area = h * w
    lo, hi = math.log(ratio[0]), math.log(ratio[1])
    for a in range(_ATTEMPTS):
        target = area * (scale[0] + (scale[1] - scale[0]) * u[2 * a])
        ar = math.exp(lo + (hi - lo) * u[2 * a + 1])
        cw, ch = round(math.sqrt(target * ar)), round(math.sqrt(target / ar))
        if 0 < cw <= w and 0 < ch <= h:
            y = int(u[2 * _ATTEMPTS] * (h - ch + 1))
            x = int(u[2 * _ATTEMPTS + 1] * (w - cw + 1))
            return (y, x, ch, cw)
    in_ratio = w / h  # fallback: the centre crop of the nearest allowed ratio
    if in_ratio < ratio[0]:
        cw, ch = w, max(1, round(w / ratio[0]))
    elif in_ratio > ratio[1]:
        ch, cw = h, max(1, round(h * ratio[1]))
    else:
        cw, ch = w, h
    return ((h - ch) // 2, (w - cw) // 2, ch, cw)


_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 whose outputs pass as independent uniforms."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniforms(seed: int, epoch: int, rows: Sequence[int], n: int) -> np.ndarray:
    """``len(rows) × n`` uniforms in [0, 1), each a function of (seed, epoch, row, j) alone."""
    mask = (1 << 64) - 1
    with np.errstate(over="ignore"):
        key = _mix(np.array([(int(seed) & mask)], dtype=np.uint64) + _GOLDEN)
        key = _mix(key ^ np.uint64(int(epoch) & mask))
        row = _mix(key ^ np.asarray(rows, dtype=np.int64).astype(np.uint64) * _GOLDEN)
        z = _mix(row[:, None] + (np.arange(1, n + 1, dtype=np.uint64) * _GOLDEN)[None, :])
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


__all__ = ["Augment", "Draw", "Op", "RandomHorizontalFlip", "RandomResizedCrop", "Resize", "uniforms"]
