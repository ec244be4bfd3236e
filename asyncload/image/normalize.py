"""Model-ready image batches: ``normalize=(mean, std)``, ``layout="NCHW"`` and ``dtype=`` as loader settings.

Why here and not in every training loop: each loop otherwise converts, permutes and normalizes the same
uint8 NHWC batch on its own, on the training thread. The loader does it once per batch where it already
holds the pixels: on the CPU in the decode stage (on the loader's CPU pool), or on the device after the
GPU decode (``gpu.finish``, ``assembly``) and in ``DeviceFeed`` after the uint8 copy.

The arithmetic is torchvision's ``ToDtype(torch.float32, scale=True)`` then ``Normalize(mean, std)``:
``x.float().mul_(1 / 255)``, minus ``mean``, divided by ``std``, per channel, in float32, then one cast to
``dtype``. A uint8 pixel has 256 values, so that arithmetic is done once per channel and value, into a
table of ``channels × 256`` outputs, and a batch is a table lookup: every output is bit-for-bit the
float32 arithmetic (then the one cast), on the CPU and on the device alike, at the cost of one pass that
reads a byte and writes the result. On the CPU the lookup is OpenCV's ``LUT`` (GIL released, the
float16/bfloat16 tables as their 16-bit patterns), and for NCHW one ``split`` of each image's result into
its planes; on a device it is one gather from the table.

``dtype`` without ``normalize`` is ``ToDtype(dtype, scale=True)`` alone (pixels in 0..1); ``normalize``
without ``dtype`` gives float32; ``layout="NCHW"`` alone permutes the uint8 batch. Only image columns are
touched: masks are class ids and stay uint8 ``H×W``.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ..errors import ConfigError
from ..runtime.alloc import allocate

Layout = Literal["NHWC", "NCHW"]
LAYOUTS = ("NHWC", "NCHW")
#: The dtypes an image column may be delivered in (``None``: uint8, as stored).
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _numbers(name: str, value: Any) -> tuple[float, ...]:
    ok = isinstance(value, Sequence) and not isinstance(value, str) and len(value) >= 1
    ok = ok and all(isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if not ok:
        raise ConfigError(f"{name}={value!r} is not allowed: a list of finite numbers, one per channel")
    return tuple(float(v) for v in value)


@dataclass(frozen=True)
class ModelReady:
    """What becomes of an image column's uint8 ``[B, H, W, C]`` batch: ``mean``/``std`` (None: none),
    ``layout`` and ``dtype`` (None: uint8). Frozen and picklable: it travels in the decode ``DecodeStage``."""

    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    layout: Layout = "NHWC"
    dtype: torch.dtype | None = None
    _tables: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @classmethod
    def of(cls, normalize: Any = None, layout: Any = "NHWC", dtype: Any = None) -> ModelReady | None:
        """The settings validated (``ConfigError`` naming the setting), or None when they change nothing."""
        mean = std = None
        if normalize is not None:
            pair = isinstance(normalize, Sequence) and not isinstance(normalize, str) and len(normalize) == 2
            if not pair:
                raise ConfigError(f"normalize={normalize!r} is not allowed: (mean, std), each a list per channel")
            mean, std = _numbers("normalize mean", normalize[0]), _numbers("normalize std", normalize[1])
            if len(mean) != len(std):
                raise ConfigError(
                    f"normalize={normalize!r} is not allowed: mean has {len(mean)} values and std {len(std)}; "
                    "one of each per channel"
                )
            if any(s == 0 for s in std):
                raise ConfigError(f"normalize={normalize!r} is not allowed: a std of 0 divides by zero")
        if layout not in LAYOUTS:
            raise ConfigError(f"layout={layout!r} is not allowed: 'NHWC' or 'NCHW'")
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(
                f"dtype={dtype!r} is not allowed: None (uint8 as stored), torch.float32, torch.float16 or "
                "torch.bfloat16 (normalized pixels are not integers)"
            )
        if mean is None and layout == "NHWC" and dtype is None:
            return None
        if mean is not None and dtype is None:
            dtype = torch.float32
        return cls(mean, std, layout, dtype)

    def __getstate__(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "layout": self.layout, "dtype": self.dtype}

    def __setstate__(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_tables", {})
        object.__setattr__(self, "_lock", threading.Lock())

    @property
    def out_dtype(self) -> torch.dtype:
        return self.dtype or torch.uint8

    def channels_ok(self, channels: int, column: str) -> None:
        """``ConfigError`` when ``mean``/``std`` do not have one value per channel of ``column``."""
        if self.mean is not None and len(self.mean) != channels:
            raise ConfigError(
                f"normalize=({list(self.mean)}, {list(self.std or ())}) is not allowed for column {column!r}: it "
                f"has {channels} channels but mean and std have {len(self.mean)} values"
            )

    def table(self, channels: int, column: str, device: torch.device | None = None) -> torch.Tensor:
        """``[channels, 256]``: the output for each channel and uint8 value (``ToDtype`` + ``Normalize``)."""
        key = (channels, str(device or "cpu"))
        got = self._tables.get(key)
        if got is not None:
            return got
        self.channels_ok(channels, column)
        v = torch.arange(256, dtype=torch.uint8)
        if self.dtype is None:
            t = v[None].expand(channels, 256).contiguous()
        else:
            x = v.to(torch.float32).mul_(1.0 / 255)[None].expand(channels, 256)  # ToDtype(scale=True)
            if self.mean is not None and self.std is not None:
                mean = torch.tensor(self.mean, dtype=torch.float32)[:, None]
                std = torch.tensor(self.std, dtype=torch.float32)[:, None]
                x = x.sub(mean).div_(std)  # Normalize
            t = x.contiguous().to(self.dtype)
        if device is not None:
            t = t.to(device)
        with self._lock:
            self._tables[key] = t
        return t

    # -- a batch -------------------------------------------------------------------------------------

    def apply(self, x: torch.Tensor, column: str) -> torch.Tensor:
        """``x``: uint8 ``[B, H, W, C]`` (or one ``[H, W, C]`` sample) on any device → the model-ready tensor."""
        if x.dtype != torch.uint8 or x.ndim not in (3, 4):
            raise ConfigError(
                f"column {column!r} is {x.dtype} of shape {tuple(x.shape)}; normalize, layout and dtype "
                "take uint8 images [B, H, W, C]"
            )
        if x.ndim == 3:
            return self.apply(x[None], column)[0]
        if x.device.type == "cpu" and x.shape[-1] in (3, 4):
            return self._cpu(x, column)
        return self.on_device(x, column)

    def on_device(self, x: torch.Tensor, column: str) -> torch.Tensor:
        """The lookup as torch ops (the device path; any channel count): one gather from the table."""
        c = x.shape[-1]
        table = self.table(c, column, x.device).reshape(-1)
        offsets = torch.arange(0, 256 * c, 256, dtype=torch.int32, device=x.device)
        if self.layout == "NCHW":
            x, offsets = x.permute(0, 3, 1, 2), offsets[:, None, None]
        idx = x.to(torch.int32, memory_format=torch.contiguous_format).add_(offsets)
        return table[idx]

    def _cpu(self, x: torch.Tensor, column: str) -> torch.Tensor:
        """OpenCV's ``LUT`` per image (3 or 4 channels), written into a tensor from ``collate.allocate``
        (a fan-out worker's shared memory where that is where batches go)."""
        import cv2

        b, h, w, c = x.shape
        table = self.table(c, column)
        half = table.dtype in (torch.float16, torch.bfloat16)  # OpenCV takes their 16-bit patterns
        lut = (table.view(torch.int16) if half else table).T.contiguous().numpy().reshape(1, 256, c)
        shape = (b, c, h, w) if self.layout == "NCHW" else (b, h, w, c)
        out = allocate(shape, self.out_dtype)
        dst = (out.view(torch.int16) if half else out).numpy()
        src = x.numpy()
        if self.layout == "NHWC":
            for i in range(b):
                cv2.LUT(src[i], lut, dst=dst[i])
            return out
        scratch = np.empty((h, w, c), dst.dtype)
        for i in range(b):
            cv2.LUT(src[i], lut, dst=scratch)
            cv2.split(scratch, list(dst[i]))
        return out

    def batch(self, batch: dict[str, Any], columns: Iterable[str]) -> dict[str, Any]:
        """``batch`` with each of ``columns`` made model-ready: a tensor (stacked or padded), or a list of
        samples (``ragged="list"``). Other keys are left as they are."""
        for c in columns:
            v = batch.get(c)
            if isinstance(v, torch.Tensor):
                batch[c] = self.apply(v, c)
            elif isinstance(v, list) and v and all(isinstance(t, torch.Tensor) for t in v):
                batch[c] = [self.apply(t, c) for t in v]
        return batch


def image_columns(columns: Mapping[str, Any]) -> list[str]:
    """The columns of a decode stage's ``columns`` whose role is ``image`` (masks stay class ids)."""
    return [c for c, col in columns.items() if getattr(col, "role", None) == "image"]


__all__ = ["DTYPES", "LAYOUTS", "Layout", "ModelReady", "image_columns"]
