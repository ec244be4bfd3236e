"""The CRC32 every value on the node store carries, written with the part and checked on each read back.

ISA-L's (python-isal) where it is installed: the same polynomial and the same values as ``zlib.crc32``,
so parts written under either read back under the other, at a small fraction of zlib 1.2's CPU per MB
(benchmarks/results/cpu/). zlib's where python-isal has no wheel for the platform.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32

    #: Which implementation this process checks with: zlib on a machine python-isal has wheels for is a fault
    #: (tests/test_nodestore_checksum.py).
    IMPLEMENTATION = "isal"
except ImportError:  # pragma: no cover - a platform python-isal has no wheel for
    from zlib import crc32

    IMPLEMENTATION = "zlib"

__all__ = ["IMPLEMENTATION", "crc32"]
