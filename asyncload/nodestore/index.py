"""The node's one index: a SQLite database in WAL mode, ``<root>/index.sqlite3``, that every process of the
node reads and changes in short transactions; the part files are only its payload.

Why one index: every process sees one total of bytes used (the limit holds for the node), one truth about
which rows are present, and one claim per bin being fetched. SQLite was chosen over ``diskcache`` (SQLite
plus files too) because the store groups rows in parts and claims carry a process's liveness, which a
key-value cache would have to be bent into; the standard library's module costs no dependency.

Trust: SQLite opens files by path and follows links, so the index is opened only after the root is private
(``root.open_root``), by the kernel's name of the checked directory (``root.proc_path``), and its files
(the database, its WAL and shared memory) must be plain files of the user's that no one else can write, or
the index is not used (``Unreadable``): the store then sets it aside and starts a new one.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from .root import private_file

NAME = "index.sqlite3"
#: A file a process leaves in the root when it finds the index damaged in use (its error inside): the next
#: process to open the store checks every page and rebuilds the index.
FLAG = "index.damaged"
FILES = (NAME, NAME + "-wal", NAME + "-shm", NAME + "-journal")

#: The index's format: a store written by another is set aside and started anew. 3: pickled values carry a
#: MAC, the bytes used are the parts' allocated blocks.
FORMAT = 3

SCHEMA = """
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

#: WAL pages after which a commit checkpoints (SQLite's default 1000 is 4 MiB of log, as much as a small
#: limit); after one the log is cut back to nothing. The index and its log are counted against the limit,
#: the log as at least ``LOG_ROOM`` (what it grows to between checkpoints), so that the count does not
#: move with it.
AUTOCHECKPOINT = 64
LOG_ROOM = (AUTOCHECKPOINT + 16) * 4096


class Unreadable(Exception):
    """The index cannot be trusted or read (not the user's, not a database, damaged, another format)."""


def full_disk(exc: BaseException) -> bool:
    """Whether ``exc`` says the disk (or the user's quota) is full."""
    if isinstance(exc, OSError):
        return exc.errno in (28, 122)  # ENOSPC, EDQUOT
    return isinstance(exc, sqlite3.OperationalError) and "full" in str(exc)


def damaged(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite says the index itself is damaged (not a database, malformed, a missing table), rather
    than that it could not get at it now (locked, a full disk, an I/O error)."""
    text = str(exc)
    return not isinstance(exc, sqlite3.OperationalError) or any(
        t in text for t in ("malformed", "not a database", "corrupt", "no such table", "no such column")
    )


class Index:
    """The index in the root directory open at ``root_fd`` (``path``: the kernel's name for it). One
    connection per process (a forked child opens its own at its first use)."""

    def __init__(self, root_fd: int, path: str) -> None:
        self.root_fd = root_fd
        self.path = path
        self._pid = -1
        self._db: sqlite3.Connection | None = None
        self._lock = threading.RLock()

    def check_files(self) -> None:
        """``Unreadable`` where a file of the index is there and is not a plain file of the user's that no one
        else can write (a link, another user's)."""
        for name in FILES:
            try:
                st = os.stat(name, dir_fd=self.root_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not private_file(st):
                raise Unreadable(f"{name} is not a private file of this user's (uid {st.st_uid}, mode "
                                 f"{st.st_mode & 0o7777:04o})")  # fmt: skip

    def _connect(self) -> sqlite3.Connection:
        """A connection, the schema made by whichever process comes first. Switching to WAL answers "database
        is locked" at once to processes that open the index at the same instant: tried again for a minute.
        On a full disk an index already made opens without writing (so what is stored is still read)."""
        self.check_files()
        uri = Path(self.path, NAME).as_uri() + "?mode=rwc"
        db = sqlite3.connect(uri, uri=True, timeout=60.0, isolation_level=None, check_same_thread=False)
        try:
            self.check_files()  # (what SQLite opened is what was checked: no one else can change the root)
            deadline = time.monotonic() + 60.0
            while True:
                try:
                    made = db.execute("SELECT COUNT(*) FROM sqlite_master WHERE name = 'claims'").fetchone()[0]
                    if not made or db.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
                        db.execute("PRAGMA journal_mode=WAL")  # (kept in the file: once for the node)
                        db.executescript("BEGIN IMMEDIATE;" + SCHEMA + "COMMIT;")
                        db.execute("INSERT OR IGNORE INTO meta VALUES ('format', ?), ('used', 0)", (FORMAT,))
                    break
                except sqlite3.OperationalError as exc:
                    if db.in_transaction:
                        db.execute("ROLLBACK")
                    if "locked" not in str(exc) or time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            db.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses the last transactions, never the index
            db.execute("PRAGMA journal_size_limit=0")
            db.execute(f"PRAGMA wal_autocheckpoint={AUTOCHECKPOINT}")
            row = db.execute("SELECT v FROM meta WHERE k = 'format'").fetchone()
        except sqlite3.DatabaseError as exc:
            db.close()
            if damaged(exc):
                raise Unreadable(f"{type(exc).__name__}: {exc}") from None
            raise  # (locked, a full disk, an I/O error: the store is off in this process, the index kept)
        except BaseException:
            db.close()
            raise
        if row is None or row[0] != FORMAT:
            db.close()
            raise Unreadable(f"an index of format {row[0] if row else '?'}, not {FORMAT}")
        return db

    def verify(self, full: bool = False) -> None:
        """``Unreadable`` where SQLite finds the index damaged: at every open its header, schema and format
        (what connecting reads); ``full``, every page (``quick_check``, which reads the whole index: done
        only where a process found it damaged in use, ``FLAG``)."""
        try:
            with self.transaction(write=False) as db:
                (ok,) = db.execute("PRAGMA quick_check(1)" if full else "SELECT 'ok' FROM meta LIMIT 1").fetchone()
        except sqlite3.DatabaseError as exc:
            if damaged(exc):
                raise Unreadable(f"{type(exc).__name__}: {exc}") from None
            raise
        if ok != "ok":
            raise Unreadable(f"damaged ({ok})")

    @contextlib.contextmanager
    def transaction(self, write: bool = True) -> Iterator[sqlite3.Connection]:
        """This process's connection (a new one after a fork: a connection never crosses one), in a
        transaction that takes the index's write lock at once where ``write`` (so that a check and the change
        it allows are one step for the whole node)."""
        with self._lock:
            if self.root_fd < 0:
                raise sqlite3.OperationalError("the node store is closed")
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

    def disk_bytes(self) -> int:
        """What the index and its log take on disk (allocated blocks; the log as at least ``LOG_ROOM``)."""
        n = []
        for name in FILES[:3]:
            try:
                n.append(os.stat(name, dir_fd=self.root_fd, follow_symlinks=False).st_blocks * 512)
            except OSError:
                n.append(0)
        return n[0] + max(n[1], LOG_ROOM) + n[2]

    def set_aside(self) -> str:
        """Move the index out of the way (``index.sqlite3.unreadable``, replacing an older one; its log and
        shared memory removed): the name it now has."""
        self.close()
        aside = NAME + ".unreadable"
        os.replace(NAME, aside, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
        for name in FILES[1:]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=self.root_fd)
        return aside

    def close(self) -> None:
        with self._lock:
            db, self._db, self._pid = self._db, None, -1
        if db is not None:
            with contextlib.suppress(sqlite3.Error):
                db.close()

    @staticmethod
    def used(db: sqlite3.Connection) -> int:
        return int(db.execute("SELECT v FROM meta WHERE k = 'used'").fetchone()[0])

    @staticmethod
    def add_used(db: sqlite3.Connection, nbytes: int) -> None:
        db.execute("UPDATE meta SET v = v + ? WHERE k = 'used'", (nbytes,))


__all__ = ["FLAG", "FORMAT", "LOG_ROOM", "Index", "Unreadable", "damaged", "full_disk"]
