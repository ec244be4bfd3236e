"""Image files' bytes → arrays, for the object-store source: PNG/JPEG decoded with Pillow.

Why a pool of threads sized to the cores: Pillow releases the GIL while decoding, so decoding runs in
parallel off the loop thread, which only moves bytes. Images come out ``H×W×3`` uint8, masks ``H×W``
uint8 (palette/grey values as stored).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Literal

import numpy as np

from ..errors import ConfigError

DecodeMode = Literal["rgb", "gray"]


def decode_modes(columns: Sequence[str], decode: Mapping[str, DecodeMode] | None) -> dict[str, DecodeMode]:
    """The mode per column: ``decode``'s, else ``gray`` for columns whose name contains "mask", else ``rgb``."""
    modes: dict[str, DecodeMode] = {c: ("gray" if "mask" in c.lower() else "rgb") for c in columns}
    modes.update(decode or {})
    for c, m in modes.items():
        if m not in ("rgb", "gray"):
            raise ConfigError(f"decode[{c!r}]={m!r} is not allowed: 'rgb' or 'gray'")
    return modes


def default_workers() -> int:
    """Decode threads when none are asked for: one per core this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def decode_image(data: bytes, mode: DecodeMode, where: str) -> np.ndarray:
    """PNG/JPEG bytes → ``H×W×3`` (``rgb``) or ``H×W`` (``gray``: palette index or grey value) uint8."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as opened:
            img: Image.Image = opened
            if mode == "rgb":
                if img.mode != "RGB":
                    img = img.convert("RGB")
                arr = np.asarray(img)
            else:
                if img.mode in ("L", "P"):
                    arr = np.asarray(img)
                elif img.mode == "1":
                    arr = np.asarray(img).astype(np.uint8)
                elif img.mode in ("RGB", "RGBA", "LA"):  # a mask saved with channels: the first one
                    arr = np.asarray(img.getchannel(0))
                else:
                    arr = np.asarray(img.convert("L"))
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"cannot decode {where} as an image ({len(data)} bytes): {exc}") from exc
    if arr.dtype != np.uint8:
        raise ValueError(f"{where} decodes to {arr.dtype}, expected 8-bit data")
    return arr


__all__ = ["DecodeMode", "decode_image", "decode_modes", "default_workers"]
