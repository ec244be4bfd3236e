"""The node-local block store: rows fetched from a remote store, kept on this machine's disk.

Why: a segmentation model reads its dataset 50-200 times. Without a local copy every epoch pulls the whole
dataset again from the store, every DataLoader worker and fan-out process fetches its own rows of each
block, and rows fetched ahead of their turn sit in the heap. Here the first process of the node that needs
a block fetches it and writes it down; every other process, every later epoch and the next run of the job
read it from local disk.

**One index for the node.** Every process on the node (ranks, DataLoader workers, fan-out processes, the
next run) reads and changes one SQLite database in WAL mode, ``<root>/index.sqlite3``, in short
transactions; the files under ``<root>/parts/`` are only its payload. So every process sees one total of
bytes used (the limit holds for the node, not per process), one truth about which rows are present (a row
one process wrote is found by all at their next look; nothing is fetched twice because a process trusted
an old view), and one claim per bin being fetched. Nothing walks the tree at run time. SQLite was chosen
over ``diskcache`` (which is SQLite plus files too) because the store needs rows grouped in parts and
claims with a process's liveness, which a key-value cache would have to be bent into; the standard
library's module costs no dependency (``benchmarks/results/nodestore/index.md`` has the cost per row).

- **Keys name what shaped the bytes**: a shelf is a dataset at one version (``Source.store_key``: its
  identity, such as Deep Lake's ``ds.id``, and its commit; the source's type and, for a user's subclass, a
  digest of its code), an entry is a row of a column (the column's name, whether it holds stored bytes or
  decoded values, and ``Source.value_tag``: the settings that change decoded values). Rows are the
  dataset's own (``Source.row_ids``), so the splits, queries and column sets of one dataset share them,
  and opening one never removes another.
- **Exact values**: bytes, text, arrays of any non-object dtype (structured, datetime, 0-d), numpy scalars
  come back with their type, dtype and shape; anything else is pickled (Python values, ragged lists, JSON
  objects). A value that cannot be pickled makes its column unkeepable (``Unkeepable``), said once.
- **Crash-safe and verified**: room is reserved in the index before a part is written (a reservation of a
  process that died is reclaimed), the part's rows enter the index only once the file is whole, in one
  transaction; every row carries a CRC32, checked on every read; a part that fails is dropped from the index
  and fetched again, never decoded.
- **Bounded**: at most ``limit`` bytes of parts (the index's own rows counted at ``ENTRY_COST`` each) for
  the whole node. A write that does not fit first evicts whole shelves that no process holds in use (least
  recently used first); if it still does not fit it is not kept, and the rows already on disk stay (a fixed
  resident part: with a new random order every epoch, evicting to make room only trades one resident row
  for another at the cost of a write, ``benchmarks/results/nodestore/``).
- **Never fails an epoch**: a directory that cannot be used, or a full disk, turns the store off in this
  process with one warning; the rows are then read from the remote as without it.

The files are plain (no mmap): rows read from them land in the page cache, which the kernel reclaims, not in
the process's anonymous memory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import logging
import os
import pickle
import shutil
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.gather import write_all
from ..runtime.log import log_once

log = logging.getLogger("asyncload")

#: Rows per bin: the unit a process claims before it fetches, so that one process of the node fetches a
#: block while the others wait for it. Deep Lake's own block: a block read whole is one bin.
BIN = 64

#: The default limit: a quarter of the space free on the store's filesystem, at most this much. A node's
#: local disk is usually shared (scratch, other jobs' checkpoints): a quarter never fills it, and 256 GiB
#: holds the segmentation sets our users train on (Cityscapes 11 GB, ADE20K 4 GB, COCO 25 GB).
DEFAULT_LIMIT_CAP = 256 << 30

#: Bytes the index spends on one row of one column (its key, where it lies, its checksum), counted against
#: the limit with the parts, so that the limit bounds the whole store on disk.
ENTRY_COST = 96

#: How long a claim on a bin holds off other processes when its holder cannot be seen to be alive (another
#: pid namespace) or has not finished: the rows are then fetched twice, which costs bytes, never correctness.
CLAIM_PATIENCE_S = 30.0

_FORMAT = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS shelves(id INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT UNIQUE NOT NULL,
    label TEXT NOT NULL, used REAL NOT NULL);
CREATE TABLE IF NOT EXISTS parts(id INTEGER PRIMARY KEY AUTOINCREMENT, shelf INTEGER NOT NULL,
    bytes INTEGER NOT NULL, owner TEXT NOT NULL, done INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS parts_of_shelf ON parts(shelf);
CREATE TABLE IF NOT EXISTS entries(shelf INTEGER NOT NULL, col TEXT NOT NULL, row INTEGER NOT NULL,
    part INTEGER NOT NULL, off INTEGER NOT NULL, len INTEGER NOT NULL, crc INTEGER NOT NULL, how TEXT NOT NULL,
    PRIMARY KEY(shelf, col, row)) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS entries_of_part ON entries(part);
CREATE TABLE IF NOT EXISTS claims(shelf INTEGER NOT NULL, bin INTEGER NOT NULL, owner TEXT NOT NULL,
    since REAL NOT NULL, PRIMARY KEY(shelf, bin)) WITHOUT ROWID;
"""

#: File systems the store is not put on unless asked (``cache_dir``, ``$ASYNCLOAD_CACHE_DIR``): network
#: ones, where SQLite's locks and ``flock`` are emulated or missing and free space ignores quotas, and
#: memory-backed ones, where the store would take the RAM that training needs.
NOT_LOCAL = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "beegfs",
             "fuse.", "9p", "afs", "panfs", "wekafs", "tmpfs", "ramfs")  # fmt: skip


# -- where the store lives -------------------------------------------------------------------------------
def fs_type(path: Path) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it), "" where unknown."""
    best, kind = "", ""
    p = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            f = line.split()
            if len(f) >= 3:
                mnt = f[1].replace("\\040", " ")
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, f[2]
    return kind


def _local(path: Path) -> bool:
    kind = fs_type(_existing(path))
    return not any(kind == t or (t.endswith(".") and kind.startswith(t)) for t in NOT_LOCAL)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def candidates() -> list[Path]:
    """Where the store may live by default, in order: ``$XDG_CACHE_HOME`` (else ``~/.cache``), then
    ``$TMPDIR`` (on clusters the job's node-local scratch), then ``/var/tmp``; each under
    ``asyncload-<uid>/blocks`` for the last two (shared directories)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    home = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    out = [home / "asyncload" / "blocks"]
    for scratch in (os.environ.get("TMPDIR"), "/var/tmp"):
        if scratch:
            out.append(Path(scratch) / f"asyncload-{os.getuid()}" / "blocks")
    return out


def default_root() -> Path | None:
    """Where the store lives unless ``cache_dir`` says: ``$ASYNCLOAD_CACHE_DIR`` where set, else the first of
    ``candidates()`` on a local, disk-backed file system; None (the store off, one line saying what to
    set) where none is."""
    env = os.environ.get("ASYNCLOAD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    found = candidates()
    for c in found:
        if _local(c):
            return c
    log_once(
        "asyncload: the node block store is off: none of "
        + ", ".join(f"{c} ({fs_type(_existing(c)) or '?'})" for c in found)
        + " is on a local disk; set cache_dir (or ASYNCLOAD_CACHE_DIR) to node-local scratch to keep blocks",
        logging.WARNING,
    )
    return None


_claims = itertools.count()


def _owner(claim: int = 0) -> str:
    """Who holds a reservation (``claim`` 0) or a claim (a number of its own: two reads of one process
    exclude each other too): the process, its pid namespace (a pid means nothing in another one: a
    container beside this one sharing the directory) and the claim."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{ns}:{os.getpid()}:{claim}"


def _alive(owner: str) -> bool | None:
    """Whether ``owner``'s process lives: True, False, or None where it cannot be told (another namespace)."""
    ns, pid, _ = (owner.split(":") + ["", ""])[:3]
    if ns != _owner().split(":")[0]:
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def _write_all(path: Path, bufs: list[bytes | memoryview]) -> None:
    """``bufs`` as a new file at ``path``, in gather writes rather than one call per value: a part of 64
    photo rows is 128 values, and a write call each cost more than the copy (17 µs a row of ``put``'s
    ~32 µs)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        write_all(fd, bufs)
    finally:
        os.close(fd)


# -- values ----------------------------------------------------------------------------------------------
class Unkeepable(Exception):
    """A value the store cannot give back exactly (it cannot be pickled): its column is read through."""


def encode(value: Any) -> tuple[bytes | memoryview, str]:
    """A row's value as bytes, and how to rebuild it exactly (type, dtype, shape)."""
    if type(value) is bytes:
        return value, "b"
    if type(value) is str:
        return value.encode("utf-8", "surrogatepass"), "s"
    if isinstance(value, memoryview):  # a reader process's answer: bytes to every reader of a batch
        return value.cast("B"), "b"
    if type(value) is np.ndarray and not value.dtype.hasobject:
        flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)  # (a view: datetime and structured too)
        return memoryview(flat), "a" + json.dumps([np.lib.format.dtype_to_descr(value.dtype), value.shape])
    if isinstance(value, np.generic) and not value.dtype.hasobject:
        return np.asarray(value).reshape(-1).view(np.uint8).tobytes(), "n" + json.dumps(
            np.lib.format.dtype_to_descr(value.dtype)
        )
    try:
        return pickle.dumps(value, protocol=5), "p"
    except Exception as exc:  # noqa: BLE001 - any failure of any value's pickling
        raise Unkeepable(f"a {type(value).__module__}.{type(value).__qualname__} cannot be pickled ({exc})") from None


def decode(buf: bytes | bytearray, how: str) -> Any:
    """The value ``encode`` wrote as ``buf``."""
    kind = how[:1]
    if kind == "b":
        return bytes(buf)
    if kind == "s":
        return bytes(buf).decode("utf-8", "surrogatepass")
    if kind == "a":
        descr, shape = json.loads(how[1:])
        return np.frombuffer(buf, np.lib.format.descr_to_dtype(_tuples(descr))).reshape(shape)
    if kind == "n":
        return np.frombuffer(buf, np.lib.format.descr_to_dtype(_tuples(json.loads(how[1:]))))[0]
    return pickle.loads(buf)


def _tuples(descr: Any) -> Any:
    """A dtype description read back from JSON (lists where numpy wrote tuples)."""
    if isinstance(descr, list):
        return [tuple(_tuples(x) if isinstance(x, list) else x for x in field) for field in descr]
    return descr


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
    """A part whose bytes do not match their checksum, cut short or gone: its rows are fetched again."""

    def __init__(self, part: int) -> None:
        super().__init__(part)
        self.part = part


# -- the store -------------------------------------------------------------------------------------------
class NodeStore:
    """The store under ``root``, at most ``limit`` bytes for the node (None: a quarter of the free space, at
    most ``DEFAULT_LIMIT_CAP``). One per process and root (``NodeStore.at``); a forked child opens its own
    connection to the index at its first use."""

    _open: dict[tuple[int, str], NodeStore] = {}
    _refused: set[tuple[int, str]] = set()  # roots that could not be used by this process
    _open_lock = threading.Lock()

    def __init__(self, root: Path, limit: int | None) -> None:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if root.stat().st_uid != os.getuid():  # its parts are unpickled: only the user's own are trusted
            raise PermissionError(errno.EACCES, f"owned by uid {root.stat().st_uid}, not this user", str(root))
        self.root = root
        self.parts = root / "parts"
        self.parts.mkdir(exist_ok=True)
        (root / "in-use").mkdir(exist_ok=True)
        self._pid = -1
        self._db: sqlite3.Connection | None = None
        self._lock = threading.RLock()
        self.disabled: str | None = None
        with self.transaction() as db:  # (the first use makes the schema)
            used = self._used(db)
        if limit is None:
            free = shutil.disk_usage(root).free
            limit = min(DEFAULT_LIMIT_CAP, (free + used) // 4)
        self.limit = limit
        self._reclaim()
        self._shelves: dict[str, Shelf] = {}
        self._announced: set[str] = set()

    # -- the index -----------------------------------------------------------------------------------
    def _connect(self) -> sqlite3.Connection:
        """A connection to the index, made (WAL mode, the schema) by whichever process comes first. Switching
        to WAL answers "database is locked" at once, without waiting, to processes that open the index at
        the same instant: tried again for up to a minute."""
        db = sqlite3.connect(self.root / "index.sqlite3", timeout=60.0, isolation_level=None, check_same_thread=False)
        deadline = time.monotonic() + 60.0
        while True:
            try:
                if db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                    db.execute("PRAGMA journal_mode=WAL")  # (kept in the file: once for the node)
                db.executescript("BEGIN IMMEDIATE;" + _SCHEMA + "COMMIT;")
                break
            except sqlite3.OperationalError as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses the last transactions, never the index
        db.execute("PRAGMA journal_size_limit=1048576")  # the log cut back to 1 MiB at each checkpoint
        db.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?), ('used', 0)", (_FORMAT,))
        (fmt,) = db.execute("SELECT v FROM meta WHERE k = 'format'").fetchone()
        if fmt != _FORMAT:
            raise OSError(
                errno.EINVAL, f"an index of format {fmt}, not {_FORMAT}: remove the directory", str(self.root)
            )
        return db

    @contextlib.contextmanager
    def transaction(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """This process's connection (a new one after a fork: a connection never crosses one), in a
        transaction that takes the index's write lock at once where ``write`` (so that a check and the change
        it allows are one step for the whole node)."""
        with self._lock:
            if self._pid != os.getpid():
                self._db, self._pid = self._connect(), os.getpid()
            db = self._db
            assert db is not None
            db.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    @staticmethod
    def _used(db: sqlite3.Connection) -> int:
        return int(db.execute("SELECT v FROM meta WHERE k = 'used'").fetchone()[0])

    @staticmethod
    def _add_used(db: sqlite3.Connection, nbytes: int) -> None:
        db.execute("UPDATE meta SET v = v + ? WHERE k = 'used'", (nbytes,))

    def used(self) -> int:
        """Bytes the store holds on this node (parts, reservations and the index's rows)."""
        with self.transaction(write=False) as db:
            return self._used(db)

    def part_path(self, part: int) -> Path:
        return self.parts / str(part // 4096) / f"{part}.rows"

    @classmethod
    def at(cls, root: Path, limit: int | None) -> NodeStore | None:
        """This process's store at ``root`` (opened once), or None with one warning where it cannot be
        used (the directory cannot be created, written or trusted)."""
        key = (os.getpid(), str(root))
        with cls._open_lock:
            store = cls._open.get(key)
            if store is None:
                if key in cls._refused:  # said once; the directory is not tried again by this process
                    return None
                try:
                    store = cls(root, limit)
                except (OSError, sqlite3.Error) as exc:
                    cls._refused.add(key)
                    _warn_off(root, exc)
                    return None
                cls._open[key] = store
            elif limit is not None:
                store.limit = limit
            return store if store.disabled is None else None

    # -- shelves -------------------------------------------------------------------------------------
    def shelf(self, key: str, label: str) -> Shelf | None:
        """The shelf of the dataset version ``key`` (``Source.store_key``), held in use by this process until
        its last reader releases it (``Shelf.release``): no process evicts a shelf that one holds."""
        with self._lock:
            have = self._shelves.get(key)
            if have is not None:
                have.users += 1
                return have
            try:
                with self.transaction() as db:
                    db.execute(
                        "INSERT OR IGNORE INTO shelves(key, label, used) VALUES (?, ?, ?)", (key, label, time.time())
                    )
                    db.execute("UPDATE shelves SET used = ? WHERE key = ?", (time.time(), key))
                    (sid,) = db.execute("SELECT id FROM shelves WHERE key = ?", (key,)).fetchone()
                fd = os.open(self.root / "in-use" / str(sid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                fcntl.flock(fd, fcntl.LOCK_SH)
            except (OSError, sqlite3.Error) as exc:
                self.failed(exc)
                return None
            have = self._shelves[key] = Shelf(self, key, sid, fd)
            announce = key not in self._announced
            self._announced.add(key)
        if announce:
            log.info(
                "asyncload: node block store: %s is kept in %s (limit %.1f GB for this node, %.1f GB used)",
                label, self.root, self.limit / 1e9, self.used() / 1e9,
            )  # fmt: skip
        return have

    def release(self, shelf: Shelf) -> None:
        """``Shelf.release``: the last reader of ``shelf`` in this process gone, its in-use lock is dropped."""
        with self._lock:
            shelf.users -= 1
            if shelf.users > 0 or self._shelves.get(shelf.key) is not shelf:
                return
            del self._shelves[shelf.key]
            fd, shelf._inuse_fd = shelf._inuse_fd, -1
        if fd >= 0:
            os.close(fd)  # closing releases the shared flock

    def _in_use(self, sid: int) -> bool:
        """Whether a process holds shelf ``sid`` in use (this one included)."""
        if any(s.id == sid for s in self._shelves.values()):
            return True
        try:
            fd = os.open(self.root / "in-use" / str(sid), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # (the probe's own lock goes with it)
        return False

    # -- room ----------------------------------------------------------------------------------------
    def full(self, sid: int) -> bool:
        """Whether a write for shelf ``sid`` would find no room (within 2% of the limit), even after evicting
        every shelf that no process uses."""
        with self.transaction(write=False) as db:
            used = self._used(db)
            others = db.execute(
                "SELECT shelf, SUM(bytes) FROM parts WHERE shelf != ? GROUP BY shelf", (sid,)
            ).fetchall()
        free = self.limit - used + sum(n for other, n in others if not self._in_use(other))
        return free < 0.02 * self.limit

    def reserve(self, sid: int, nbytes: int) -> int | None:
        """A new part of shelf ``sid`` with room for ``nbytes``: its id, or None where the limit cannot make
        room (shelves no process uses are evicted first, least recently used first)."""
        gone: list[int] = []
        try:
            with self.transaction() as db:
                if self._used(db) + nbytes > self.limit:
                    gone += self._reclaim_in(db)
                    for (other,) in db.execute("SELECT id FROM shelves WHERE id != ? ORDER BY used", (sid,)).fetchall():
                        if self._used(db) + nbytes <= self.limit:
                            break
                        if not self._in_use(other):
                            gone += self._evict_in(db, other)
                if self._used(db) + nbytes > self.limit:
                    part = None
                else:
                    cur = db.execute("INSERT INTO parts(shelf, bytes, owner) VALUES (?, ?, ?)", (sid, nbytes, _owner()))
                    part = cur.lastrowid
                    self._add_used(db, nbytes)
        except sqlite3.Error as exc:
            self.failed(exc)
            return None
        self._unlink_parts(gone)
        return part

    def _evict_in(self, db: sqlite3.Connection, sid: int) -> list[int]:
        parts = [p for (p,) in db.execute("SELECT id FROM parts WHERE shelf = ?", (sid,))]
        (nbytes,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM parts WHERE shelf = ?", (sid,)).fetchone()
        db.execute("DELETE FROM entries WHERE shelf = ?", (sid,))
        db.execute("DELETE FROM parts WHERE shelf = ?", (sid,))
        db.execute("DELETE FROM claims WHERE shelf = ?", (sid,))
        db.execute("DELETE FROM shelves WHERE id = ?", (sid,))
        self._add_used(db, -nbytes)
        log.info("asyncload: node store: evicted shelf %d (%.1f MB), used by no process", sid, nbytes / 1e6)
        return parts

    def _reclaim_in(self, db: sqlite3.Connection) -> list[int]:
        """Reservations of processes that died before their part was whole: their room back."""
        dead = [(p, n) for p, n, owner in db.execute("SELECT id, bytes, owner FROM parts WHERE done = 0")
                if _alive(owner) is False]  # fmt: skip
        for p, n in dead:
            db.execute("DELETE FROM parts WHERE id = ?", (p,))
            self._add_used(db, -n)
        return [p for p, _ in dead]

    def _reclaim(self) -> None:
        with self.transaction() as db:
            gone = self._reclaim_in(db)
        self._unlink_parts(gone)

    def _unlink_parts(self, parts: Sequence[int]) -> None:
        for p in parts:
            with contextlib.suppress(OSError):
                self.part_path(p).unlink()

    def drop(self, part: int) -> None:
        """Remove ``part`` (corrupt, or not kept): its rows leave the index and its room is given back."""
        try:
            with self.transaction() as db:
                row = db.execute("SELECT bytes FROM parts WHERE id = ?", (part,)).fetchone()
                if row is not None:
                    db.execute("DELETE FROM entries WHERE part = ?", (part,))
                    db.execute("DELETE FROM parts WHERE id = ?", (part,))
                    self._add_used(db, -row[0])
        except sqlite3.Error as exc:
            self.failed(exc)
        self._unlink_parts([part])

    def failed(self, exc: BaseException) -> None:
        """The disk or the index refused (full, read-only, gone): the store is off in this process from now
        on, said once."""
        if self.disabled is None:
            self.disabled = f"{type(exc).__name__}: {exc}"
            _warn_off(self.root, exc)


class Shelf:
    """One dataset version's rows in the node's store, as this process reads and writes them. Every call
    that touches the disk or the index blocks: the read stage makes them on a pool thread."""

    def __init__(self, store: NodeStore, key: str, sid: int, inuse_fd: int) -> None:
        self.store = store
        self.key = key
        self.id = sid
        self._inuse_fd = inuse_fd
        self.users = 1  # the readers of this process holding it (``NodeStore.shelf``, ``release``)

    @property
    def off(self) -> bool:
        """Whether the store was turned off in this process (a write or the index failed)."""
        return self.store.disabled is not None

    # -- what is there -------------------------------------------------------------------------------
    def lookup(self, rows: Sequence[int], cols: Sequence[str]) -> dict[int, dict[str, Entry]]:
        """Of ``rows`` (the dataset's row numbers), those present for every column of ``cols``, with where each
        lies."""
        found: dict[int, dict[str, Entry]] = {}
        if not rows or self.off:
            return found
        want = sorted(set(rows))
        try:
            with self.store.transaction(write=False) as db:
                for col in cols:
                    for lo in range(0, len(want), 500):
                        chunk = want[lo : lo + 500]
                        q = (f"SELECT row, part, off, len, crc, how FROM entries WHERE shelf = ? AND col = ? "
                             f"AND row IN ({','.join('?' * len(chunk))})")  # fmt: skip
                        for r, *e in db.execute(q, (self.id, col, *chunk)):
                            found.setdefault(r, {})[col] = Entry(*e)
        except sqlite3.Error as exc:
            self.store.failed(exc)
            return {}
        return {r: e for r, e in found.items() if len(e) == len(cols)}

    def get(self, entries: Sequence[Entry]) -> list[Any]:
        """The values of ``entries``, each checked against its CRC32 (``CorruptPart`` names the part)."""
        out: list[Any] = []
        fds: dict[int, int] = {}
        try:
            for e in entries:
                fd = fds.get(e.part)
                if fd is None:
                    try:
                        fd = fds[e.part] = os.open(self.store.part_path(e.part), os.O_RDONLY | os.O_CLOEXEC)
                    except FileNotFoundError:
                        raise CorruptPart(e.part) from None
                buf = bytearray(e.len)
                n = os.preadv(fd, [buf], e.off)
                if n != e.len or zlib.crc32(buf) != e.crc:
                    raise CorruptPart(e.part)
                out.append(decode(buf, e.how))
        finally:
            for fd in fds.values():
                os.close(fd)
        return out

    def forget(self, part: int) -> None:
        """Drop a part found corrupt: its rows leave the index, its file goes."""
        self.store.drop(part)

    # -- writing -------------------------------------------------------------------------------------
    def put(self, rows: Sequence[int], cols: Mapping[str, Sequence[Any]]) -> bool:
        """Write ``rows`` (the dataset's row numbers; their values per column key) as one part. False where the
        store did not keep them (over its limit, the disk refused); ``Unkeepable`` where a value cannot be
        kept exactly. Rows another process wrote meanwhile keep that process's copy."""
        bufs: list[bytes | memoryview] = []
        meta: list[tuple[str, int, int, int, int, str]] = []
        off = 0
        for col, values in cols.items():
            for r, v in zip(rows, values, strict=True):
                data, how = encode(v)
                n = data.nbytes if isinstance(data, memoryview) else len(data)
                meta.append((col, int(r), off, n, zlib.crc32(data), how))
                bufs.append(data)
                off += n
        store = self.store
        if store.disabled is not None:
            return False
        nbytes = off + ENTRY_COST * len(meta)
        part = store.reserve(self.id, nbytes)
        if part is None:
            return False
        path = store.part_path(part)
        try:
            path.parent.mkdir(exist_ok=True)
            _write_all(path, bufs)
        except OSError as exc:
            store.drop(part)
            store.failed(exc)
            return False
        try:
            with store.transaction() as db:
                before = db.total_changes
                db.executemany(
                    "INSERT OR IGNORE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(self.id, c, r, part, o, n, crc, how) for c, r, o, n, crc, how in meta],
                )
                if db.total_changes == before:  # every row was written by another process meanwhile
                    db.execute("DELETE FROM parts WHERE id = ?", (part,))
                    store._add_used(db, -nbytes)
                    part_kept = False
                else:
                    db.execute("UPDATE parts SET done = 1 WHERE id = ?", (part,))
                    part_kept = True
        except sqlite3.Error as exc:
            store.drop(part)
            store.failed(exc)
            return False
        if not part_kept:
            store._unlink_parts([part])
        return True

    # -- one fetch per node --------------------------------------------------------------------------
    def claim(self, bins: Sequence[int]) -> str | None:
        """The node-wide claim of every bin of ``bins`` for a fetch, all or none in one step (so that two
        fetches over overlapping runs of bins never both go ahead, and never wait on each other): its
        holder's name (for ``unclaim``), or None while another fetch of a live process holds one of them."""
        me, now = _owner(next(_claims) + 1), time.time()
        try:
            with self.store.transaction() as db:
                for b in bins:
                    row = db.execute(
                        "SELECT owner, since FROM claims WHERE shelf = ? AND bin = ?", (self.id, b)
                    ).fetchone()
                    if row is not None and _alive(row[0]) is not False:
                        if now - row[1] < CLAIM_PATIENCE_S:  # (past it: a holder stuck, fetched regardless)
                            return None
                db.executemany(
                    "INSERT OR REPLACE INTO claims VALUES (?, ?, ?, ?)", [(self.id, b, me, now) for b in bins]
                )
        except sqlite3.Error as exc:
            self.store.failed(exc)
        return me

    def unclaim(self, bins: Sequence[int], holder: str) -> None:
        """Give back the claim ``holder`` (``claim``'s answer) took on ``bins``."""
        with contextlib.suppress(sqlite3.Error):
            with self.store.transaction() as db:
                db.executemany(
                    "DELETE FROM claims WHERE shelf = ? AND bin = ? AND owner = ?", [(self.id, b, holder) for b in bins]
                )

    def release(self) -> None:
        """One reader of this process is done with the shelf. When none is left, its in-use lock goes, so
        that the shelf may be evicted for another's rows (a long-lived process, a notebook, that read one
        version and then another does not keep the old one from being evicted)."""
        self.store.release(self)


def open_shelf(key: str | None, label: str, root: str | os.PathLike[str] | None, limit: int | None) -> Shelf | None:
    """The node store's shelf for the dataset version ``key`` under ``root`` (None: ``default_root``), or
    None where it is not kept (no version, a store that cannot be used here)."""
    if key is None:
        log_once(f"asyncload: {label} is not kept on the node block store: its version is unknown", logging.INFO)
        return None
    where = Path(root).expanduser() if root is not None else default_root()
    if where is None:
        return None
    store = NodeStore.at(where, limit)
    return store.shelf(key, label) if store is not None else None


def _warn_off(root: Path, exc: BaseException) -> None:
    why = "the disk is full" if getattr(exc, "errno", None) == errno.ENOSPC else f"{type(exc).__name__}: {exc}"
    log.warning(
        "asyncload: the node block store at %s cannot be used (%s): reading from the store without it. "
        "Set cache_dir (or ASYNCLOAD_CACHE_DIR) to a writable local directory, or cache=False",
        root, why,
    )  # fmt: skip


__all__ = [
    "BIN",
    "CorruptPart",
    "Entry",
    "NodeStore",
    "Shelf",
    "Unkeepable",
    "candidates",
    "decode",
    "default_root",
    "encode",
    "open_shelf",
]
