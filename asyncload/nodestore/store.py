"""``NodeStore``: the root, the index and the parts put together — room, eviction, the lives of shelves —
and what the store does when the disk or the index fails (a shelf's own reads, writes and claims:
``shelf``).

- **Bounded by what the disk holds**: at most ``limit`` bytes for the node, counting each part's allocated
  blocks and the index with its log. A write that does not fit first evicts whole shelves that no process
  holds in use (least recently used first); if it still does not fit it is not kept and the rows already
  on disk stay (a fixed resident part: with a new random order every epoch, evicting to make room only
  trades one resident row for another at the cost of a write, ``benchmarks/results/nodestore/``).
- **A margin of the file system is never written into** (``margin``: 5% of its size, at most 1 GiB): the
  store stops keeping rows before the disk fills, so the index can still be changed and other programs
  still write. Where the disk fills anyway (another program), writes stop, said once, and what is stored
  is still read; a new process opens a full store without writing.
- **Heals itself**: a part that fails its check is dropped and fetched again; an index that cannot be read
  or trusted is moved aside and a new one started (its parts removed), said in one line; at open, part
  files the index does not know (a process killed mid-eviction) are removed, as are reservations of
  processes that died.
- **Shelves in use**: a process holds a shared ``flock`` on ``in-use/<shelf>`` while it reads a shelf; an
  eviction probes it under the index's write lock, and a holder checks its shelf still exists after taking
  its lock, so an evicted shelf is never written to. The file goes with its last holder.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from ..runtime.log import log_once
from ..runtime.sizes import format_size
from .index import FLAG, LOG_ROOM, Index, Unreadable, damaged, full_disk
from .parts import Parts
from .root import NotPrivate, default_root, open_root, private_file, proc_path, sub_dir
from .shelf import BIN, Shelf, alive, owner

log = logging.getLogger("asyncload")

#: The default limit: a quarter of the space free on the store's filesystem, at most this much. A node's
#: local disk is usually shared (scratch, other jobs' checkpoints): a quarter never fills it, and 256 GiB
#: holds the segmentation sets our users train on (Cityscapes 11 GB, ADE20K 4 GB, COCO 25 GB).
DEFAULT_LIMIT_CAP = 256 << 30

#: Bytes the index grows by for one row of one column (its key, where it lies, its checksum): room asked
#: for with a part, as the index's size on disk is counted against the limit.
ENTRY_COST = 96

#: The free space the store never writes into: this share of the file system's size, at most ``MARGIN_CAP``.
MARGIN_SHARE = 0.05
MARGIN_CAP = 1 << 30


def margin(st: os.statvfs_result) -> int:
    """The free space of a file system (``statvfs``) the store leaves alone."""
    return min(MARGIN_CAP, int(st.f_blocks * st.f_frsize * MARGIN_SHARE))


class NodeStore:
    """The store under ``root``, at most ``limit`` bytes for the node (None: a quarter of the free space, at
    most ``DEFAULT_LIMIT_CAP``). One per process and root while a loader uses it (``NodeStore.at``,
    ``open_shelf``): the last shelf released closes its files. A forked child opens its own connection to the
    index at its first use."""

    _open: ClassVar[dict[tuple[int, str], NodeStore]] = {}
    _refused: ClassVar[set[tuple[int, str]]] = set()  # roots that could not be used by this process
    _open_lock: ClassVar[threading.RLock] = threading.RLock()

    def __init__(self, root: Path, limit: int | None) -> None:
        self.root = root
        self.fd = open_root(root)
        try:
            self.index = Index(self.fd, proc_path(self.fd, root))
            self._lock = threading.RLock()
            self.disabled: str | None = None  # why the store is off in this process (the index failed)
            self.no_room: str | None = None  # why it keeps no more rows (the disk full): it is still read
            self._shelves: dict[str, Shelf] = {}
            self._quiet: set[str] = set()  # shelves whose first line is said (or not to be said)
            self._inuse = sub_dir(self.fd, "in-use", root / "in-use")
            self.parts = Parts(sub_dir(self.fd, "parts", root / "parts"), root / "parts")
            self._open_index()
            vfs = os.fstatvfs(self.fd)
            self.block = vfs.f_frsize or 4096
            if limit is None:
                limit = min(DEFAULT_LIMIT_CAP, (vfs.f_bavail * vfs.f_frsize + self.on_disk()) // 4)
            self.limit = limit
        except BaseException:
            self.close()
            raise

    # -- opening: the index checked, rebuilt where unreadable, what it does not know reclaimed ---------------
    def _open_index(self) -> None:
        """Under the node's open lock (one process at a time checks, rebuilds and sweeps): the index opened
        and checked (set aside and started anew where it cannot be read or trusted, said once), reservations
        of dead processes and part files it does not know removed."""
        lock = self._lock_file()
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            flagged = self._read_flag()
            try:
                self.index.verify(full=flagged is not None)  # (an index not the user's, not a database, ...)
            except Unreadable as why:
                self._rebuild(str(why))
            else:
                if flagged is not None:  # (the pages all read: what failed was not the index's)
                    with contextlib.suppress(OSError):
                        os.unlink(FLAG, dir_fd=self.fd)
            try:
                with self.index.transaction() as db:  # (the listing under the index's write lock: one truth)
                    gone = self._reclaim_in(db)
                    listed = set(self.parts.listing())
                    known = {p for (p,) in db.execute("SELECT id FROM parts")}
                    lost = [p for (p,) in db.execute("SELECT id FROM parts WHERE done = 1") if p not in listed]
                    for p in lost:  # (deleted by hand, or by a cleaner of the scratch disk)
                        self._drop_in(db, p)
                self.parts.unlink(gone)
                freed = self.parts.sweep(known, sorted(listed))
                if freed or lost:
                    log.info("asyncload: node block store at %s: %s of parts no index row names removed, %d parts "
                             "whose files are gone forgotten", self.root, format_size(freed), len(lost))  # fmt: skip
            except (OSError, sqlite3.Error) as exc:
                if not full_disk(exc):
                    raise
                self.failed(exc)
        finally:
            os.close(lock)

    def _lock_file(self) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open("open.lock", flags, 0o600, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            os.unlink("open.lock", dir_fd=self.fd)
            fd = os.open("open.lock", flags, 0o600, dir_fd=self.fd)
        if not private_file(os.fstat(fd)):
            os.close(fd)
            os.unlink("open.lock", dir_fd=self.fd)
            return self._lock_file()
        return fd

    def _rebuild(self, why: str) -> None:
        """The index cannot be used: moved aside, its parts removed (what they hold cannot be found without
        it), a new index started. One line says so."""
        aside = self.index.set_aside() if self._exists("index.sqlite3") else None
        self.parts.close()
        shutil.rmtree("parts", dir_fd=self.fd, ignore_errors=True)
        if self._exists("parts"):  # (another user's files in it: moved aside whole)
            os.rename("parts", f"untrusted.parts.{time.time_ns()}", src_dir_fd=self.fd, dst_dir_fd=self.fd)
        self.parts = Parts(sub_dir(self.fd, "parts", self.root / "parts"), self.root / "parts")
        log.warning(
            "asyncload: the node block store's index at %s could not be used (%s): %sits parts removed, "
            "and a new index started; the rows are fetched again",
            self.root / "index.sqlite3", why, f"moved aside to {aside}, " if aside else "",
        )  # fmt: skip
        with contextlib.suppress(OSError):
            os.unlink(FLAG, dir_fd=self.fd)
        self.index.check_files()
        self.index.verify()

    def _read_flag(self) -> str | None:
        """What a process that found the index damaged in use wrote (``index.FLAG``), or None."""
        try:
            fd = os.open(FLAG, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError:
            return None
        try:
            return os.read(fd, 4096).decode("utf-8", "replace") if private_file(os.fstat(fd)) else None
        finally:
            os.close(fd)

    def _flag(self, exc: BaseException) -> None:
        """The index failed as damaged in use: the next open checks every page (and rebuilds it)."""
        with contextlib.suppress(OSError):
            fd = os.open(FLAG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self.fd)  # fmt: skip
            try:
                os.write(fd, f"{type(exc).__name__}: {exc}".encode())
            finally:
                os.close(fd)

    def _exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    @classmethod
    def at(cls, root: Path, limit: int | None) -> NodeStore | None:
        """This process's store at ``root`` (opened once while in use), or None with one warning where it
        cannot be used (the directory cannot be created, written or trusted)."""
        key = (os.getpid(), str(root))
        with cls._open_lock:
            store = cls._open.get(key)
            if store is None:
                if key in cls._refused:  # said once; the directory is not tried again by this process
                    return None
                try:
                    store = cls(root, limit)
                except (OSError, sqlite3.Error, Unreadable) as exc:
                    cls._refused.add(key)
                    _warn_off(root, exc)
                    return None
                cls._open[key] = store
            elif limit is not None:
                store.limit = limit
            return store if store.disabled is None else None

    def close(self) -> None:
        """Close the index, the directories and the in-use locks of this process (``open_shelf``'s last
        shelf released does it)."""
        with self._lock if hasattr(self, "_lock") else contextlib.nullcontext():
            shelves = list(getattr(self, "_shelves", {}).values())
            for s in shelves:
                s.users = 0
                self._unhold(s)
            if hasattr(self, "_shelves"):
                self._shelves.clear()
        if hasattr(self, "index"):
            self.index.close()
            self.index.root_fd = -1
        if hasattr(self, "parts"):
            self.parts.close()
        for fd in (getattr(self, "_inuse", -1), self.fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._inuse = self.fd = -1
        with NodeStore._open_lock:
            key = (os.getpid(), str(self.root))
            if NodeStore._open.get(key) is self:
                del NodeStore._open[key]

    # -- the index -----------------------------------------------------------------------------------
    def transaction(self, write: bool = True) -> Any:
        return self.index.transaction(write)

    def used(self) -> int:
        """Bytes of parts the store holds on this node (allocated blocks, reservations included)."""
        with self.transaction(write=False) as db:
            return Index.used(db)

    def on_disk(self) -> int:
        """What the limit bounds: the parts (``used``) and the index with its log."""
        return self.used() + self.index.disk_bytes()

    def room(self) -> int:
        """The limit less what the index and its log take: what parts may fill."""
        return self.limit - self.index.disk_bytes()

    def part_path(self, part: int) -> Path:
        return self.parts.path_of(part)

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
                got = self._hold(key, label)
            except (OSError, sqlite3.Error) as exc:
                self.failed(exc)
                return None
            if got is None:
                return None
            have = self._shelves[key] = Shelf(self, key, label, *got)
        return have

    def _hold(self, key: str, label: str) -> tuple[int, int] | None:
        """The shelf's id and a descriptor holding its in-use lock. The lock is taken after the id is read and
        the shelf is looked for again under the index's write lock after: an eviction between the two (it
        probes locks under that write lock) is seen, and the shelf made anew."""
        for _ in range(10):
            try:
                with self.transaction() as db:
                    now = time.time()
                    db.execute("INSERT OR IGNORE INTO shelves(key, label, used) VALUES (?, ?, ?)", (key, label, now))
                    db.execute("UPDATE shelves SET used = ? WHERE key = ?", (now, key))
                    (sid,) = db.execute("SELECT id FROM shelves WHERE key = ?", (key,)).fetchone()
            except sqlite3.OperationalError as exc:
                if not full_disk(exc):
                    raise
                self.failed(exc)  # a full disk: the shelf read as it is, with no lock (no room to evict for)
                with self.transaction(write=False) as db:
                    row = db.execute("SELECT id FROM shelves WHERE key = ?", (key,)).fetchone()
                return (row[0], -1) if row else None
            fd = self._lock_inuse(sid)
            with self.transaction() as db:
                if db.execute("SELECT 1 FROM shelves WHERE id = ?", (sid,)).fetchone():
                    return sid, fd
            os.close(fd)
        raise OSError(errno.EAGAIN, "a shelf evicted ten times over while being opened", str(self.root))

    def _lock_inuse(self, sid: int) -> int:
        """A shared lock on ``in-use/<sid>``, on the file that is there once it is held (a last holder of
        another process may remove the file between this one's open and its lock)."""
        name = str(sid)
        while True:
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self._inuse)
            except OSError as exc:  # a link or another user's file planted while the root was open: removed
                if exc.errno not in (errno.ELOOP, errno.EACCES):
                    raise
                os.unlink(name, dir_fd=self._inuse)
                continue
            if not private_file(os.fstat(fd)):
                os.close(fd)
                os.unlink(name, dir_fd=self._inuse)
                continue
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                if os.stat(name, dir_fd=self._inuse, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
            os.close(fd)

    def release(self, shelf: Shelf) -> None:
        """``Shelf.release``: the last reader of ``shelf`` in this process gone, its in-use lock is dropped
        (and its file removed where no other process holds it); the last shelf gone, the store's files are
        closed (``NodeStore.close``)."""
        with NodeStore._open_lock, self._lock:
            shelf.users -= 1
            if shelf.users > 0 or self._shelves.get(shelf.key) is not shelf:
                return
            del self._shelves[shelf.key]
            self._unhold(shelf)
            if not self._shelves and NodeStore._open.get((os.getpid(), str(self.root))) is self:
                self.close()

    def _unhold(self, shelf: Shelf) -> None:
        fd, shelf._inuse_fd = shelf._inuse_fd, -1
        if fd < 0 or self._inuse < 0:
            return
        name = str(shelf.id)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (no other holder: the file goes with this one)
            if os.stat(name, dir_fd=self._inuse, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(name, dir_fd=self._inuse)
        os.close(fd)  # closing releases the lock

    def _in_use(self, sid: int) -> bool:
        """Whether a process holds shelf ``sid`` in use (this one included)."""
        if any(s.id == sid for s in self._shelves.values()):
            return True
        try:
            fd = os.open(str(sid), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._inuse)
        except FileNotFoundError:
            return False
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
    def alloc(self, nbytes: int) -> int:
        """What ``nbytes`` in a file take on disk: whole blocks."""
        return -(-nbytes // self.block) * self.block

    def disk_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more (and the index's log) leave the file system its margin."""
        st = os.fstatvfs(self.fd)
        return st.f_bavail * st.f_frsize - nbytes - LOG_ROOM >= margin(st)

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran (its descriptors are gone: nothing is read or written any more)."""
        return self.fd < 0

    def full(self, sid: int) -> bool:
        """Whether a write for shelf ``sid`` would find no room (within 2% of the limit, even after evicting
        every shelf that no process uses, or the disk at its margin)."""
        if self.closed or self.no_room is not None or not self.disk_room(BIN * ENTRY_COST):
            return True
        with self.transaction(write=False) as db:
            used = Index.used(db) + self.index.disk_bytes()
            others = db.execute(
                "SELECT shelf, SUM(bytes) FROM parts WHERE shelf != ? GROUP BY shelf", (sid,)
            ).fetchall()
        free = self.limit - used + sum(n for other, n in others if not self._in_use(other))
        return free < 0.02 * self.limit

    def reserve(self, sid: int, nbytes: int, rows: int = 0) -> int | None:
        """A new part of shelf ``sid`` for ``nbytes`` of ``rows`` values: its id, or None where the limit
        cannot make room (shelves no process uses are evicted first, least recently used first), the disk
        is at its margin, or the shelf is gone."""
        need = self.alloc(nbytes)
        grow = ENTRY_COST * rows  # (what the index will grow by)
        if self.no_room is not None or not self.disk_room(need + grow):
            return None
        gone: list[int] = []
        try:
            with self.transaction() as db:
                if db.execute("SELECT 1 FROM shelves WHERE id = ?", (sid,)).fetchone() is None:
                    return None
                index = self.index.disk_bytes() + grow
                if Index.used(db) + index + need > self.limit:
                    gone += self._reclaim_in(db)
                    for (other,) in db.execute("SELECT id FROM shelves WHERE id != ? ORDER BY used", (sid,)).fetchall():
                        if Index.used(db) + index + need <= self.limit:
                            break
                        if not self._in_use(other):
                            gone += self._evict_in(db, other)
                if Index.used(db) + index + need > self.limit:
                    part = None
                else:
                    cur = db.execute("INSERT INTO parts(shelf, bytes, owner) VALUES (?, ?, ?)", (sid, need, owner()))
                    part = cur.lastrowid
                    Index.add_used(db, need)
        except sqlite3.Error as exc:
            self.failed(exc)
            return None
        self.parts.unlink(gone)
        return part

    def _evict_in(self, db: sqlite3.Connection, sid: int) -> list[int]:
        parts = [p for (p,) in db.execute("SELECT id FROM parts WHERE shelf = ?", (sid,))]
        (nbytes,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM parts WHERE shelf = ?", (sid,)).fetchone()
        db.execute("DELETE FROM entries WHERE shelf = ?", (sid,))
        db.execute("DELETE FROM parts WHERE shelf = ?", (sid,))
        db.execute("DELETE FROM claims WHERE shelf = ?", (sid,))
        db.execute("DELETE FROM shelves WHERE id = ?", (sid,))
        Index.add_used(db, -nbytes)
        with contextlib.suppress(OSError):
            os.unlink(str(sid), dir_fd=self._inuse)
        log.info("asyncload: node block store: evicted shelf %d (%s), used by no process", sid, format_size(nbytes))
        return parts

    def _reclaim_in(self, db: sqlite3.Connection) -> list[int]:
        """Reservations of processes that died before their part was whole: their room back."""
        dead = [(p, n) for p, n, who in db.execute("SELECT id, bytes, owner FROM parts WHERE done = 0")
                if alive(who) is False]  # fmt: skip
        for p, n in dead:
            db.execute("DELETE FROM parts WHERE id = ?", (p,))
            Index.add_used(db, -n)
        return [p for p, _ in dead]

    def drop(self, part: int) -> None:
        """Remove ``part`` (corrupt, or not kept): its rows leave the index and its room is given back."""
        if self.closed:
            return
        try:
            with self.transaction() as db:
                self._drop_in(db, part)
        except sqlite3.Error as exc:
            self.failed(exc)
        self.parts.unlink([part])

    @staticmethod
    def _drop_in(db: sqlite3.Connection, part: int) -> None:
        row = db.execute("SELECT bytes FROM parts WHERE id = ?", (part,)).fetchone()
        if row is not None:
            db.execute("DELETE FROM entries WHERE part = ?", (part,))
            db.execute("DELETE FROM parts WHERE id = ?", (part,))
            Index.add_used(db, -row[0])

    def failed(self, exc: BaseException) -> None:
        """The disk or the index refused. A full disk: no more rows are kept, and what is stored is still read
        (said once). Anything else (read-only, gone, damaged): the store is off in this process from now on,
        said once; the next process to open it checks the index and rebuilds it where it cannot be read."""
        if self.closed:  # (a read of an epoch abandoned as its loader closed: nothing to say)
            return
        if full_disk(exc):
            if self.no_room is None:
                self.no_room = f"{type(exc).__name__}: {exc}"
                log.warning(
                    "asyncload: the disk under the node block store at %s is full: no more rows are kept; the "
                    "rows it holds are still read from it. Free space there, or set cache_dir elsewhere",
                    self.root,
                )  # fmt: skip
        elif self.disabled is None:
            self.disabled = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, sqlite3.DatabaseError) and damaged(exc):
                self._flag(exc)
                log.warning(
                    "asyncload: the node block store's index at %s is damaged (%s): reading from the store without "
                    "it in this process; the next process to open it checks it and starts a new one",
                    self.root / "index.sqlite3", self.disabled,
                )  # fmt: skip
            else:
                _warn_off(self.root, exc)

    # -- the first line ------------------------------------------------------------------------------
    def announce(self, shelf: Shelf) -> None:
        """Say once where ``shelf``'s rows are kept (at its first row written or read, so that a store that
        cannot keep them says only that)."""
        if shelf.key in self._quiet:
            return
        self._quiet.add(shelf.key)
        with contextlib.suppress(OSError, sqlite3.Error):
            log.info(
                "asyncload: node block store: %s is kept in %s (limit %s for this node, %s used)",
                shelf.label, self.root, format_size(self.limit), format_size(self.on_disk()),
            )  # fmt: skip

    def quiet(self, shelf: Shelf) -> None:
        """``shelf``'s rows are read through (the limit too small for them): no line says they are kept."""
        self._quiet.add(shelf.key)


def open_shelf(key: str | None, label: str, root: str | os.PathLike[str] | None, limit: int | None) -> Shelf | None:
    """The node store's shelf for the dataset version ``key`` under ``root`` (None: ``default_root``), or
    None where it is not kept (no version, a store that cannot be used here)."""
    if key is None:
        log_once(f"asyncload: {label} is not kept on the node block store: its version is unknown", logging.INFO)
        return None
    where = Path(root).expanduser() if root is not None else default_root()
    if where is None:
        return None
    with NodeStore._open_lock:
        store = NodeStore.at(where, limit)
        shelf = store.shelf(key, label) if store is not None else None
        if shelf is None and store is not None and not store._shelves:
            store.close()  # (none in use: the files are not held open)
        return shelf


def _warn_off(root: Path, exc: BaseException) -> None:
    if isinstance(exc, NotPrivate):
        why = exc.strerror
        log.warning("asyncload: the node block store is off: %s", why)
        return
    why = "the disk is full" if getattr(exc, "errno", None) == errno.ENOSPC else f"{type(exc).__name__}: {exc}"
    log.warning(
        "asyncload: the node block store at %s cannot be used (%s): reading from the store without it. "
        "Set cache_dir (or ASYNCLOAD_CACHE_DIR) to a writable local directory, or cache=False",
        root, why,
    )  # fmt: skip


__all__ = ["DEFAULT_LIMIT_CAP", "ENTRY_COST", "MARGIN_CAP", "MARGIN_SHARE", "NodeStore", "margin", "open_shelf"]
