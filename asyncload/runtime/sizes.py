"""Sizes in bytes from what people write: one rule for every setting and flag that takes a size.

Why one parser: ``cache_limit="50GB"`` and ``--memory-budget 500MB`` used to mean different things (one
read every unit as a power of 1024, the other as a power of 1000), and ``memory_budget`` took no unit at
all. Here the units mean what their names say, as in the SI and IEC standards:

- ``KB``, ``MB``, ``GB``, ``TB``: powers of 1000 (``"500MB"`` is 500,000,000 bytes);
- ``KiB``, ``MiB``, ``GiB``, ``TiB``: powers of 1024 (``"512MiB"`` is 536,870,912 bytes);
- ``K``, ``M``, ``G``, ``T`` alone: powers of 1024, as ``dd``, ``ulimit`` and Docker read them;
- no unit, or ``B``: bytes. Case does not matter, a fraction is allowed (``"1.5GiB"``), a space too.
"""

from __future__ import annotations

import numbers
import re

__all__ = ["SIZE_FORMS", "format_size", "parse_size"]

#: What the parser accepts, in the words an error message needs.
SIZE_FORMS = "a number of bytes, or a size such as '500MB' (10^6), '512MiB' (2^20) or '2G' (2^30)"

_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(i?)(b?)|(b?))\s*", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes from an int or a size string (module docstring); ``ValueError`` naming the forms otherwise."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    m = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if m is None:
        raise ValueError(f"{value!r} is not a size: {SIZE_FORMS}")
    number, prefix, binary, b = m.group(1), m.group(2), m.group(3), m.group(4)
    if prefix is None:
        return int(float(number))
    power = "kmgt".index(prefix.lower()) + 1
    base = 1024 if binary or not b else 1000
    return int(float(number) * base**power)


def format_size(n: float) -> str:
    """Bytes as a person reads them, in the units ``parse_size`` reads back: 3 significant figures in the
    power of 1000 that shows them (512 B, 377 KB, 2.1 MB), so that a limit of "2MB" is never "0.0 GB"."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.3g} {unit}" if v < 1000 else f"{v:,.0f} {unit}"
    return f"{n:.0f} B"
