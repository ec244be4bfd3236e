"""The part files under ``<root>/parts/``: one write of many rows each, read back value by value, checked.

A part is ``parts/<id // 4096>/<id>.rows``, its id the index's (never reused). Every name is opened
relative to a descriptor of a checked directory of the user's (``root.sub_dir``), without following a
link: a new part is created with ``O_CREAT | O_EXCL`` (a name already there, left by a crash or planted, is
unlinked, never written through), a part read is opened ``O_NOFOLLOW`` and must be a plain file of the
user's that no one else can write. Every value carries a CRC32 (and a pickle its MAC, ``values``): a part
that fails either, is cut short or gone is ``CorruptPart``, dropped and fetched again, never decoded.

What the index does not know is reclaimed at open (``sweep``): the parts of a process killed between the
index's change and the unlink (an eviction, a drop), and anything else found there.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.gather import write_all
from .checksum import crc32
from .root import private_file, set_aside, sub_dir
from .values import Forged, decode

#: Parts per directory under ``parts/``.
FANOUT = 4096


@dataclass(frozen=True)
class Entry:
    """Where one row of one column lies: its part, the bytes' offset and length, their CRC32, how to rebuild
    the value."""

    part: int
    off: int
    len: int
    crc: int
    how: str


class CorruptPart(Exception):
    """A part whose bytes do not match their checksum, cut short, gone or not the user's: its rows are
    fetched again."""

    def __init__(self, part: int) -> None:
        super().__init__(part)
        self.part = part


def _name(part: int) -> tuple[str, str]:
    return str(part // FANOUT), f"{part}.rows"


def _pread(fd: int, e: Entry) -> bytes | np.ndarray:
    """``e``'s bytes, copied once out of the page cache: a ``bytes`` where the value is bytes or text (which
    ``decode`` then returns without another copy), else a writable array of its bytes, not zeroed first.
    Shorter than ``e.len`` where the part is cut short."""
    if e.how[:1] in ("b", "s"):
        return os.pread(fd, e.len, e.off)
    buf = np.empty(e.len, np.uint8)
    return buf[: os.preadv(fd, [buf], e.off)]


class Parts:
    """The part files below the directory open at ``fd`` (``<root>/parts``, shown as ``path``)."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd = fd
        self.path = path
        self._subs: dict[str, int] = {}  # a directory of parts -> its descriptor (checked once, kept)
        self._lock = threading.Lock()

    def _sub(self, name: str) -> int:
        with self._lock:
            if self.fd < 0:  # (closed: a number kept would name whatever the process opens next)
                raise OSError(errno.EBADF, "the node store is closed", str(self.path))
            fd = self._subs.get(name)
            if fd is None:
                fd = self._subs[name] = sub_dir(self.fd, name, self.path / name)
            return fd

    def path_of(self, part: int) -> Path:
        d, f = _name(part)
        return self.path / d / f

    def write(self, part: int, bufs: Sequence[bytes | memoryview]) -> None:
        """``bufs`` as the new part file ``part``, in gather writes rather than one call per value (a part of
        64 photo rows is 128 values, and a write call each cost more than the copy)."""
        d, f = _name(part)
        sub = self._sub(d)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(f, flags, 0o600, dir_fd=sub)
        except FileExistsError:  # a crash's leftover or a planted name: unlinked (a link goes, not its target)
            os.unlink(f, dir_fd=sub)
            fd = os.open(f, flags, 0o600, dir_fd=sub)
        try:
            write_all(fd, bufs)
        finally:
            os.close(fd)

    def read(self, entries: Sequence[Entry]) -> list[Any]:
        """The values of ``entries``, each checked against its CRC32 (``CorruptPart`` names the part)."""
        out: list[Any] = []
        fds: dict[int, int] = {}
        try:
            for e in entries:
                fd = fds.get(e.part)
                if fd is None:
                    fd = fds[e.part] = self._open(e.part)
                buf = _pread(fd, e)
                if len(buf) != e.len or crc32(buf) != e.crc:
                    raise CorruptPart(e.part)
                try:
                    out.append(decode(buf, e.how))
                except Forged:
                    raise CorruptPart(e.part) from None
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def _open(self, part: int) -> int:
        d, f = _name(part)
        try:
            fd = os.open(f, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._sub(d))
        except OSError:  # gone, a link, a directory of parts that is not the user's
            raise CorruptPart(part) from None
        if not private_file(os.fstat(fd)):
            os.close(fd)
            raise CorruptPart(part)
        return fd

    def unlink(self, parts: Collection[int]) -> None:
        for p in parts:
            d, f = _name(p)
            with contextlib.suppress(OSError):
                os.unlink(f, dir_fd=self._sub(d))

    def listing(self) -> list[int]:
        """Every part file there (one listing of the directories), after removing what is not a part file of
        the user's (a link, another user's file, a stray name)."""
        found: list[int] = []
        with os.scandir(self.fd) as top:
            subs = [e.name for e in top]
        for name in subs:
            st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            if not name.isdigit() or not stat.S_ISDIR(st.st_mode):
                set_aside(self.fd, name, self.path / name, "not a directory of parts")
                continue
            sub = self._sub(name)
            with os.scandir(sub) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    stem = e.name.removesuffix(".rows")
                    if e.name.endswith(".rows") and stem.isdigit() and private_file(st):
                        found.append(int(stem))
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(e.name, dir_fd=sub)
        return found

    def sweep(self, known: Collection[int], listed: Sequence[int]) -> int:
        """Remove the parts of ``listed`` (``listing``, taken before ``known`` was read from the index) that
        the index does not know: their bytes."""
        gone = [p for p in listed if p not in known]
        nbytes = 0
        for p in gone:
            d, f = _name(p)
            with contextlib.suppress(OSError):
                nbytes += os.stat(f, dir_fd=self._sub(d), follow_symlinks=False).st_blocks * 512
        self.unlink(gone)
        return nbytes

    def close(self) -> None:
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
            fd, self.fd = self.fd, -1
        for d in [*subs, fd]:
            if d >= 0:
                with contextlib.suppress(OSError):
                    os.close(d)


__all__ = ["FANOUT", "CorruptPart", "Entry", "Parts"]
