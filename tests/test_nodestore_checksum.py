"""The node store's CRC32 (``nodestore.checksum``) and the part reads it checks (``nodestore.parts``): the same
values as zlib's, so that parts written before ISA-L's CRC read back under it; every kind of value read back
exactly; a part cut short or changed is ``CorruptPart`` whatever the kind of value it holds."""

from __future__ import annotations

import importlib.util
import os
import platform
import zlib
from pathlib import Path

import numpy as np
import pytest

from asyncload.nodestore import checksum
from asyncload.nodestore.parts import CorruptPart, Entry, Parts
from asyncload.nodestore.root import sub_dir
from asyncload.nodestore.values import encode

pytestmark = pytest.mark.timeout(60)

RNG = np.random.default_rng(7)
VALUES = [
    RNG.integers(0, 256, 70_000, dtype=np.uint8).tobytes(),  # a JPEG's stored bytes
    memoryview(RNG.integers(0, 256, 5_000, dtype=np.uint8).tobytes()),  # a reader process's answer
    "a label, ünïcode",
    RNG.standard_normal((7, 13)).astype(np.float32),  # an array column
    np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2],  # not contiguous: written contiguous
    np.float64(2.5),
    b"",
]


def test_the_checksum_is_zlibs_crc32_for_every_buffer_a_value_is_written_from() -> None:
    if platform.machine() in ("x86_64", "aarch64"):  # python-isal has wheels there: the fallback is a fault
        assert importlib.util.find_spec("isal") is not None
        assert checksum.IMPLEMENTATION == "isal"
    for value in VALUES:
        data, _ = encode(value)
        assert checksum.crc32(data) == zlib.crc32(data)
    big = RNG.integers(0, 256, 3 << 20, dtype=np.uint8)
    assert checksum.crc32(big) == zlib.crc32(big)
    assert checksum.crc32(memoryview(big)[1:]) == zlib.crc32(memoryview(big)[1:])


def _written(tmp_path: Path) -> tuple[Parts, list[Entry]]:
    """``VALUES`` as part 1 of a fresh parts directory, with the entries the index would hold for them, their
    CRC32s zlib's (as a store written before this module computed them)."""
    top = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    os.chmod(tmp_path, 0o700)
    parts = Parts(sub_dir(top, "parts", tmp_path / "parts"), tmp_path / "parts")
    os.close(top)
    bufs, entries, off = [], [], 0
    for value in VALUES:
        data, how = encode(value)
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        entries.append(Entry(1, off, n, zlib.crc32(data), how))
        bufs.append(data)
        off += n
    parts.write(1, bufs)
    return parts, entries


def _same(got: object, want: object) -> bool:
    if isinstance(want, memoryview):
        return type(got) is bytes and got == want.tobytes()
    if isinstance(want, np.generic):
        return type(got) is type(want) and got == want
    if isinstance(want, np.ndarray):
        return isinstance(got, np.ndarray) and got.dtype == want.dtype and np.array_equal(got, want)
    return type(got) is type(want) and got == want


def test_every_kind_of_value_reads_back_exactly_and_arrays_are_writable(tmp_path: Path) -> None:
    parts, entries = _written(tmp_path)
    got = parts.read(entries)
    assert len(got) == len(VALUES)
    for g, want in zip(got, VALUES, strict=True):
        assert _same(g, want), (g, want)
    arrays = [g for g in got if isinstance(g, np.ndarray)]
    assert len(arrays) == 2 and all(a.flags.writeable for a in arrays)  # as before: a row the user may change
    parts.close()


@pytest.mark.parametrize("kind", ["b", "s", "a", "n"])
def test_a_part_cut_short_is_corrupt_for_every_kind_of_value(tmp_path: Path, kind: str) -> None:
    parts, entries = _written(tmp_path)
    e = next(e for e in entries if e.how[:1] == kind and e.len)
    os.truncate(parts.path_of(1), e.off + e.len - 1)  # the value's last byte gone
    with pytest.raises(CorruptPart) as info:
        parts.read([e])
    assert info.value.part == 1
    parts.close()


@pytest.mark.parametrize("kind", ["b", "s", "a", "n"])
def test_a_changed_byte_is_corrupt_for_every_kind_of_value(tmp_path: Path, kind: str) -> None:
    parts, entries = _written(tmp_path)
    e = next(e for e in entries if e.how[:1] == kind and e.len)
    path = parts.path_of(1)
    data = bytearray(path.read_bytes())
    data[e.off + e.len // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptPart):
        parts.read([e])
    assert parts.read([x for x in entries if x is not e]) is not None  # the others still read
    parts.close()
