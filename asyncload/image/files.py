"""Image files' bytes → arrays for the object-store source: the per-column mode, and one sample decoded
with asyncload's decoders (``codecs``: libjpeg-turbo, libspng; Pillow for the rest) when the loader's
decode stage does not decode it (``decode="store"``).

Images come out ``H×W×3`` uint8, masks ``H×W`` uint8 (palette indices or grey values as stored).
"""

from __future__ import annotations

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


def decode_image(data: bytes, mode: DecodeMode, where: str) -> np.ndarray:
    """PNG/JPEG (or anything Pillow opens) → ``H×W×3`` (``rgb``) or ``H×W`` (``gray``) uint8."""
    from .codecs import DecodeError, decode

    try:
        return decode(data, mode)
    except DecodeError as exc:
        raise DecodeError(f"cannot decode {where} as an image ({len(data)} bytes): {exc}") from exc


__all__ = ["DecodeMode", "decode_image", "decode_modes"]
