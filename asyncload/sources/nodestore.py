"""The node-local block store: rows fetched from a remote store, kept on this machine's disk.

Why: a segmentation model reads its dataset 50-200 times. Without a local copy every epoch pulls the whole
dataset again from the store, every DataLoader worker and fan-out process fetches its own rows of each
block, and rows fetched ahead of their turn sit in the heap. Here the first process of the node that needs
a block fetches it and writes it down; every other process, every later epoch and the next run of the job
read it from local disk, and the heap holds nothing but what is being used.

Layout, under ``root`` (``ASYNCLOAD_CACHE_DIR`` or ``~/.cache/asyncload/blocks``)::

    <root>/<dataset>/<version>/            one shelf: a dataset at one version (``Source.store_key``)
        in-use                             a shared lock held by every process reading this version
        <bin>/<column>.<part>.rows         rows of bin ``<bin>`` (``BIN`` rows) that one fetch wrote (one file
                                           per fetch and column, linked into each bin it has rows of)
        <bin>/lock                         taken while a process fetches rows of this bin

- **Never stale**: a shelf is named by the source's version (a Deep Lake commit and its query's rows, an
  object store's keys digest), so a changed remote is read into a new shelf; an older shelf of the same
  dataset is removed as soon as no process holds its ``in-use`` lock.
- **One fetch per node**: a process takes a bin's lock (``flock``, released by the kernel if the process
  dies) before it fetches rows of that bin, and looks again at what is on disk once it has it: whatever
  another process wrote meanwhile is not fetched again.
- **Crash-safe and verified**: a part is written under a temporary name and renamed into place, so a
  writer killed mid-write leaves nothing that is read; every row carries a CRC32 of its bytes, checked
  on every read; a part that fails is deleted, counted and fetched again, never decoded.
- **Bounded**: at most ``limit`` bytes in all. A write that does not fit first removes shelves no process
  uses (least recently used first); if it still does not fit it is not kept, and the rows already on disk
  stay (a fixed resident part: with a new random order every epoch, evicting to make room only trades one
  resident row for another at the cost of a write, ``benchmarks/results/nodestore/``).
- **Never fails an epoch**: a directory that cannot be written, or a full disk, turns the store off in
  this process with one warning; the rows are then read from the remote as without it.

The files are plain (no mmap): rows read from them land in the page cache, which the kernel reclaims,
not in the process's anonymous memory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError
from ..runtime.log import log_once

log = logging.getLogger("asyncload")

#: Rows per bin: the directory a row's parts live in is ``row // BIN``. Fixed for every loader of every
#: dataset (loaders with other ``shuffle_block`` settings share a shelf); Deep Lake's own block, so a
#: block read whole is one bin.
BIN = 64

#: The default limit: a quarter of the space free on the store's filesystem, at most this much. A node's
#: local disk is usually shared (scratch, other jobs' checkpoints): a quarter never fills it, and 256 GiB
#: holds the segmentation sets our users train on (Cityscapes 11 GB, ADE20K 4 GB, COCO 25 GB).
DEFAULT_LIMIT_CAP = 256 << 30

_MAGIC = b"ALNS1\n"
_HEAD = struct.Struct("<I")  # the header's length, after the magic
_TMP = ".tmp-"


def default_root() -> Path:
    """Where the store lives unless ``cache_dir`` says: ``$ASYNCLOAD_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/asyncload/blocks``, else ``~/.cache/asyncload/blocks``."""
    env = os.environ.get("ASYNCLOAD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "asyncload" / "blocks"


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string such as ``"20GB"`` or ``"512 MiB"`` (powers of 1024); ValueError else."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(?:([kmgt])i?)?b?\s*", value.lower())
    if not m:
        raise ValueError(value)
    return int(float(m.group(1)) * 1024 ** (" kmgt".index(m.group(2) or " ")))


@dataclass(frozen=True)
class Entry:
    """Where one row of one column lies: the part file, its bytes' offset and length, their CRC32, and how
    to rebuild the value (``kind``: "bytes", or "array" with ``dtype`` and ``shape``)."""

    path: str
    offset: int
    length: int
    crc: int
    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()


class CorruptPart(Exception):
    """A part whose bytes do not match their checksum (or that was cut short)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.path = path


def _encode(value: Any) -> tuple[memoryview | bytes, dict[str, Any]]:
    """A row's value as bytes to write, and what rebuilds it."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return memoryview(value).cast("B"), {"k": "bytes"}
    arr = np.asarray(value)
    if arr.dtype.hasobject:
        raise TypeError(f"a value of dtype {arr.dtype} is not kept on the node store")
    arr = np.ascontiguousarray(arr)
    return memoryview(arr).cast("B"), {"k": "array", "d": arr.dtype.str, "s": list(arr.shape)}


def column_key(column: str, stored: bool) -> str:
    """A column's name on disk: its values as stored bytes and as decoded arrays are different files."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", column)[:40]
    tag = hashlib.sha256(column.encode()).hexdigest()[:6]
    return f"{safe}-{tag}{'@b' if stored else '@a'}"


class Shelf:
    """One dataset version's rows on disk, as this process sees them. Thread-safe: the loop thread asks
    what is there, file work runs on a thread pool."""

    def __init__(self, store: NodeStore, key: str, path: Path, inuse_fd: int) -> None:
        self.store = store
        self.key = key
        self.path = path
        self._inuse_fd = inuse_fd
        self.users = 1  # the readers of this process holding it (``NodeStore.shelf``, ``release``)
        self._bins: dict[int, dict[str, dict[int, Entry]]] = {}  # bin -> column key -> row -> entry
        self._lock = threading.Lock()

    # -- what is there -------------------------------------------------------------------------
    def known(self, rows: Iterable[int], cols: Iterable[str]) -> set[int]:
        """Of ``rows``, those this process knows to be on disk for every column of ``cols`` (no disk
        access: what ``scan`` last saw and what this process wrote)."""
        cols = list(cols)
        out = set()
        for r in rows:
            b = self._bins.get(r // BIN)
            if b is not None and all(r in b.get(c, ()) for c in cols):
                out.add(r)
        return out

    def scanned(self, bin_: int) -> bool:
        return bin_ in self._bins

    def scan(self, bins: Iterable[int]) -> None:
        """Read the headers of the parts in ``bins`` from disk (blocking: on a pool thread)."""
        for b in set(bins):
            found: dict[str, dict[int, Entry]] = {}
            d = self.path / str(b)
            try:
                names = sorted(os.listdir(d))
            except FileNotFoundError:
                names = []
            for name in names:
                if not name.endswith(".rows") or name.startswith(_TMP):  # (a part being written)
                    continue
                p = d / name
                try:
                    col, entries = _read_header(p)
                except (OSError, ValueError, CorruptPart):
                    _unlink(p)
                    continue
                found.setdefault(col, {}).update((r, e) for r, e in entries.items() if r // BIN == b)
            with self._lock:
                self._bins[b] = found

    def entries(self, rows: list[int], col: str) -> list[Entry]:
        """Where ``rows`` lie; ``CorruptPart("")`` where one is no longer known (its part found corrupt by
        another read meanwhile): the caller looks again."""
        try:
            return [self._bins[r // BIN][col][r] for r in rows]
        except KeyError:
            raise CorruptPart("") from None

    def forget(self, path: str) -> None:
        """Drop a corrupt part: deleted on disk, and its bin scanned again when next asked for."""
        _unlink(Path(path))
        with self._lock:
            self._bins.pop(int(Path(path).parent.name), None)

    # -- reading and writing (blocking: on a pool thread) --------------------------------------
    def get(self, entries: list[Entry]) -> list[Any]:
        """The values of ``entries``, each checked against its CRC32 (``CorruptPart`` names the file)."""
        out: list[Any] = []
        fds: dict[str, int] = {}
        try:
            for e in entries:
                fd = fds.get(e.path)
                if fd is None:
                    try:
                        fd = fds[e.path] = os.open(e.path, os.O_RDONLY)
                    except FileNotFoundError:  # removed by another process (evicted, or found corrupt)
                        raise CorruptPart(e.path) from None
                buf = bytearray(e.length)
                n = os.preadv(fd, [buf], e.offset)
                if n != e.length or zlib.crc32(buf) != e.crc:
                    raise CorruptPart(e.path)
                if e.kind == "bytes":
                    out.append(bytes(buf))
                else:
                    out.append(np.frombuffer(buf, np.dtype(e.dtype)).reshape(e.shape))
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def put(self, rows: list[int], cols: Mapping[str, list[Any]]) -> bool:
        """Write ``rows`` (their values per column key) as one part per column, in the directory of each bin
        it holds rows of (one file, hard-linked: a fully shuffled read's rows are spread over many bins, and
        a file per bin cost a write each). False where the store did not keep them (over its limit, or the
        disk refused)."""
        bins = sorted({r // BIN for r in rows})
        plans: list[tuple[str, bytes, list[memoryview | bytes]]] = []
        total = 0
        for col, values in cols.items():
            header: dict[str, Any] = {"column": col, "rows": [int(r) for r in rows], "entries": []}
            bufs: list[memoryview | bytes] = []
            off = 0
            for value in values:
                data, how = _encode(value)
                header["entries"].append([off, len(data), zlib.crc32(data), how])
                bufs.append(data)
                off += len(data)
            name = f"{col}.{min(rows)}-{zlib.crc32(json.dumps(header['rows']).encode()):08x}.rows"
            head = json.dumps(header, separators=(",", ":")).encode()
            plans.append((name, head, bufs))
            total += len(_MAGIC) + _HEAD.size + len(head) + off
        if not self.store.reserve(total):
            return False
        written: dict[int, dict[str, dict[int, Entry]]] = {}
        tmp: Path | None = None
        try:
            for name, head, bufs in plans:
                first = self.path / str(bins[0])
                first.mkdir(exist_ok=True)
                tmp = first / f"{_TMP}{os.getpid()}-{threading.get_ident()}-{name}.writing"
                with open(tmp, "wb") as f:
                    f.write(_MAGIC + _HEAD.pack(len(head)) + head)
                    for buf in bufs:
                        f.write(buf)
                for b in bins[1:]:  # whole before it is linked anywhere: a reader sees all of it or nothing
                    d = self.path / str(b)
                    d.mkdir(exist_ok=True)
                    with contextlib.suppress(FileExistsError):  # the same rows, written by another process
                        os.link(tmp, d / name)
                os.replace(tmp, first / name)
                tmp = None
                col, entries = _parse_header(str(first / name), head, len(_MAGIC) + _HEAD.size + len(head))
                for r, e in entries.items():  # each row under its own bin's link of the part
                    b = r // BIN
                    linked = e if b == bins[0] else replace(e, path=str(self.path / str(b) / name))
                    written.setdefault(b, {}).setdefault(col, {})[r] = linked
        except OSError as exc:
            _unlink(tmp)
            self.store.failed(exc)
            return False
        with self._lock:
            for b, by_col in written.items():
                have = self._bins.setdefault(b, {})
                for col, entries in by_col.items():
                    have.setdefault(col, {}).update(entries)
        return True

    # -- one fetch per node --------------------------------------------------------------------
    def try_lock(self, bin_: int) -> int | None:
        """The lock of ``bin_`` (a file descriptor to ``unlock``), or None while another process holds it."""
        d = self.path / str(bin_)
        try:
            d.mkdir(exist_ok=True)
            fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            self.store.failed(exc)
            return -1  # no lock to be had: fetch without one
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    @staticmethod
    def unlock(fd: int) -> None:
        if fd >= 0:
            os.close(fd)  # closing releases the flock

    def release(self) -> None:
        """One reader of this process is done with the shelf. When none is left, its in-use lock goes, so
        that a process opening a newer version of the dataset may remove it (a long-lived process, a
        notebook, that read one version and then another does not keep the old one on disk)."""
        self.store.release(self)


class NodeStore:
    """The store under ``root``, at most ``limit`` bytes (None: a quarter of the free space, at most
    ``DEFAULT_LIMIT_CAP``). One per process and root (``NodeStore.at``)."""

    _open: dict[tuple[int, str], NodeStore] = {}
    _refused: set[tuple[int, str]] = set()  # roots that could not be used here
    _open_lock = threading.Lock()

    def __init__(self, root: Path, limit: int | None) -> None:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / f"{_TMP}probe-{os.getpid()}"
        probe.write_bytes(b"")  # refused here, not at the first write, if the directory is not writable
        probe.unlink()
        self.root = root
        self._used = _tree_bytes(root)
        if limit is None:
            free = shutil.disk_usage(root).free
            limit = min(DEFAULT_LIMIT_CAP, (free + self._used) // 4)
        self.limit = limit
        self.disabled: str | None = None
        self._lock = threading.Lock()
        self._since_scan = 0
        self._shelves: dict[str, Shelf] = {}
        self._announced: set[str] = set()  # keys whose first use this process has logged
        clean_temporaries(root)

    @classmethod
    def at(cls, root: Path, limit: int | None) -> NodeStore | None:
        """This process's store at ``root`` (opened once), or None with one warning where it cannot be
        used (the directory cannot be created or written)."""
        key = (os.getpid(), str(root))
        with cls._open_lock:
            store = cls._open.get(key)
            if store is None:
                if key in cls._refused:  # said once; the directory is not tried again by this process
                    return None
                try:
                    store = cls(root, limit)
                except OSError as exc:
                    cls._refused.add(key)
                    _warn_off(root, exc)
                    return None
                cls._open[key] = store
            elif limit is not None:
                store.limit = limit
            return store if store.disabled is None else None

    # -- shelves ---------------------------------------------------------------------------------
    def shelf(self, key: str, label: str) -> Shelf | None:
        """The shelf of the dataset version ``key`` (``Source.store_key``), held in use by this process
        until its last reader releases it (``Shelf.release``; one per process and key); older versions of
        the same dataset that no process uses are removed."""
        with self._lock:
            have = self._shelves.get(key)
            if have is not None:
                have.users += 1
                return have
        dataset, _, version = key.rpartition("|")
        dset = self.root / hashlib.sha256(dataset.encode()).hexdigest()[:20]
        path = dset / hashlib.sha256(version.encode()).hexdigest()[:20]
        try:
            path.mkdir(parents=True, exist_ok=True)
            (dset / "source.txt").write_text(f"{label}\n")
            fd = os.open(path / "in-use", os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.utime(path / "in-use")  # the shelf's last use, for the least-recently-used order
        except OSError as exc:
            self.failed(exc)
            return None
        for other in dset.iterdir():
            if other.is_dir() and other != path:
                self._remove_if_unused(other)
        with self._lock:
            have = self._shelves.get(key)
            if have is None:
                have = self._shelves[key] = Shelf(self, key, path, fd)
            else:  # another thread opened it meanwhile: its lock is the one kept
                have.users += 1
                os.close(fd)
            announce = key not in self._announced
            self._announced.add(key)
        if announce:
            log.info(
                "asyncload: node block store: %s is kept in %s (limit %.1f GB, %.1f GB used on this node)",
                label, path, self.limit / 1e9, self._used / 1e9,
            )  # fmt: skip
        return have

    def release(self, shelf: Shelf) -> None:
        """``Shelf.release``: the last reader of ``shelf`` gone, its in-use lock is dropped."""
        with self._lock:
            shelf.users -= 1
            if shelf.users > 0 or self._shelves.get(shelf.key) is not shelf:
                return
            del self._shelves[shelf.key]
            fd, shelf._inuse_fd = shelf._inuse_fd, -1
        if fd >= 0:
            os.close(fd)  # closing releases the shared flock

    def _remove_if_unused(self, shelf: Path) -> int:
        """Remove ``shelf`` if no process holds it in use; its bytes, or 0."""
        try:
            fd = os.open(shelf / "in-use", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError:
            return 0
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return 0
        try:
            gone = shelf.with_name(f"{_TMP}gone-{os.getpid()}-{shelf.name}")
            os.replace(shelf, gone)  # out of sight first: nobody opens it from here on
            nbytes = _tree_bytes(gone)
            shutil.rmtree(gone, ignore_errors=True)
        except OSError:
            return 0
        finally:
            os.close(fd)
        with self._lock:
            self._used -= nbytes
        log.info("asyncload: node store: removed %s (%.1f MB), used by no process", shelf, nbytes / 1e6)
        return nbytes

    # -- the limit ---------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> bool:
        """Room for ``nbytes`` more: taken (True), made by removing unused shelves, or refused (False)."""
        with self._lock:
            self._since_scan += 1
            if self._used + nbytes > self.limit and self._since_scan > 64:  # other processes write too
                self._used, self._since_scan = _tree_bytes(self.root), 0
            if self._used + nbytes <= self.limit:
                self._used += nbytes
                return True
        for shelf in self._unused_by_age():
            self._remove_if_unused(shelf)
            with self._lock:
                if self._used + nbytes <= self.limit:
                    self._used += nbytes
                    return True
        return False

    def _unused_by_age(self) -> list[Path]:
        """Every shelf under the root, least recently used first (those in use are skipped on removal)."""
        shelves = []
        for dset in self.root.iterdir():
            if dset.is_dir() and not dset.name.startswith(_TMP):
                for s in dset.iterdir():
                    if s.is_dir():
                        with contextlib.suppress(OSError):
                            shelves.append(((s / "in-use").stat().st_mtime, s))
        return [s for _, s in sorted(shelves)]

    def check_limit(self, window_bytes: int, setting: str) -> None:
        """Refuse a limit that cannot hold the rows one epoch's window keeps between their fetch and their
        turn (``window_bytes``): every fetch would be thrown away."""
        if self.limit < window_bytes:
            raise ConfigError(
                f"{setting}={self.limit:,} bytes is below what one window of this dataset keeps on the node "
                f"store ({window_bytes:,} bytes: shuffle_window rows of the sizes read so far): set cache_limit "
                f"to at least {2 * window_bytes:,} bytes, a smaller shuffle_window, or cache=False"
            )

    def failed(self, exc: OSError) -> None:
        """The disk refused a write (full, read-only, gone): the store is off in this process from now on."""
        if self.disabled is None:
            self.disabled = f"{type(exc).__name__}: {exc}"
            _warn_off(self.root, exc)


def open_shelf(key: str | None, label: str, root: str | os.PathLike[str] | None, limit: int | None) -> Shelf | None:
    """The node store's shelf for the dataset version ``key`` under ``root`` (None: ``default_root``), or
    None where it is not kept (no version, a store that cannot be used here)."""
    if key is None:
        log_once(f"asyncload: {label} is not kept on the node block store: its version is unknown", logging.INFO)
        return None
    store = NodeStore.at(Path(root).expanduser() if root is not None else default_root(), limit)
    return store.shelf(key, label) if store is not None else None


def _warn_off(root: Path, exc: OSError) -> None:
    why = "the disk is full" if getattr(exc, "errno", None) == errno.ENOSPC else f"{type(exc).__name__}: {exc}"
    log.warning(
        "asyncload: the node block store at %s cannot be used (%s): reading from the store without it. "
        "Set cache_dir (or ASYNCLOAD_CACHE_DIR) to a writable local directory, or cache=False",
        root, why,
    )  # fmt: skip


def _read_header(path: Path) -> tuple[str, dict[int, Entry]]:
    with open(path, "rb") as f:
        lead = f.read(len(_MAGIC) + _HEAD.size)
        if len(lead) != len(_MAGIC) + _HEAD.size or not lead.startswith(_MAGIC):
            raise CorruptPart(str(path))
        (n,) = _HEAD.unpack_from(lead, len(_MAGIC))
        head = f.read(n)
        if len(head) != n:
            raise CorruptPart(str(path))
    return _parse_header(str(path), head, len(lead) + n)


def _parse_header(path: str, head: bytes, base: int) -> tuple[str, dict[int, Entry]]:
    h = json.loads(head)
    entries = {}
    for r, (off, length, crc, how) in zip(h["rows"], h["entries"], strict=True):
        entries[int(r)] = Entry(path, base + off, length, crc, how["k"], how.get("d", ""), tuple(how.get("s", ())))
    return h["column"], entries


def _tree_bytes(root: Path) -> int:
    """Bytes of the files under ``root``, each file once (a part is linked into every bin it holds rows of)."""
    total = 0
    seen: set[tuple[int, int]] = set()
    for dirpath, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def _unlink(path: Path | None) -> None:
    if path is not None:
        with contextlib.suppress(OSError):
            path.unlink()


def clean_temporaries(root: Path, older_than_s: float = 3600.0) -> None:
    """Remove what writers killed mid-write left (never read: only renamed parts are)."""
    now = time.time()
    for dirpath, dirs, files in os.walk(root):
        for name in files + dirs:
            if name.startswith(_TMP):
                p = Path(dirpath) / name
                with contextlib.suppress(OSError):
                    if now - p.stat().st_mtime > older_than_s:
                        shutil.rmtree(p) if p.is_dir() else p.unlink()


__all__ = [
    "open_shelf",
    "BIN",
    "CorruptPart",
    "Entry",
    "NodeStore",
    "Shelf",
    "column_key",
    "default_root",
]
