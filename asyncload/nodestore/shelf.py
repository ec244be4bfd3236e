"""``Shelf``: one dataset version's rows in the node's store, as one process looks them up, reads them,
writes them and claims them before a fetch (``store.NodeStore`` keeps the room, the index and the files).

One fetch per node: a process claims the bins (``BIN`` rows) it is about to fetch in the index, all at
once, under a name of its own (its pid namespace, pid and a number per claim, so that two reads of one
process exclude each other too); another process waits for the rows or, where the holder died or has held
the claim longer than ``CLAIM_PATIENCE_S``, takes it over.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sqlite3
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from .checksum import crc32
from .index import Index
from .parts import Entry, Parts
from .values import encode

#: Rows per bin: the unit a process claims before it fetches, so that one process of the node fetches a
#: block while the others wait for it. Deep Lake's own block: a block read whole is one bin.
BIN = 64

#: How long a claim on a bin holds off other processes when its holder cannot be seen to be alive (another
#: pid namespace) or has not finished: the rows are then fetched twice, which costs bytes, never correctness.
CLAIM_PATIENCE_S = 30.0

_claims = itertools.count()


class Store(Protocol):
    """What a shelf asks of its store (``store.NodeStore``)."""

    parts: Parts
    disabled: str | None
    no_room: str | None

    @property
    def closed(self) -> bool: ...
    def transaction(self, write: bool = True) -> contextlib.AbstractContextManager[sqlite3.Connection]: ...
    def reserve(self, sid: int, nbytes: int, rows: int = 0) -> int | None: ...
    def drop(self, part: int) -> None: ...
    def failed(self, exc: BaseException) -> None: ...
    def announce(self, shelf: Shelf) -> None: ...
    def quiet(self, shelf: Shelf) -> None: ...
    def release(self, shelf: Shelf) -> None: ...


def owner(claim: int = 0) -> str:
    """Who holds a reservation (``claim`` 0) or a claim (a number of its own: two reads of one process
    exclude each other too): the process, its pid namespace (a pid means nothing in another one: a
    container beside this one sharing the directory) and the claim."""
    try:
        ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        ns = 0
    return f"{ns}:{os.getpid()}:{claim}"


def alive(who: str) -> bool | None:
    """Whether ``who``'s process (an ``owner``) lives: True, False, or None where it cannot be told (another
    namespace)."""
    ns, pid, _ = (who.split(":") + ["", ""])[:3]
    if ns != owner().split(":")[0]:
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


class Shelf:
    """One dataset version's rows in the node's store, as this process reads and writes them. Every call
    that touches the disk or the index blocks: the read stage makes them off its loop (``engine.keeping``)."""

    def __init__(self, store: Store, key: str, label: str, sid: int, inuse_fd: int) -> None:
        self.store = store
        self.key = key
        self.label = label
        self.id = sid
        self._inuse_fd = inuse_fd
        self.users = 1  # the readers of this process holding it (``NodeStore.shelf``, ``release``)

    @property
    def off(self) -> bool:
        """Whether the store was turned off in this process (the index failed), or closed (the loader that
        held it closed while a read of an abandoned epoch was still under way: that read goes to the source)."""
        return self.store.disabled is not None or self.store.closed

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
        if entries:
            self.store.announce(self)
        return self.store.parts.read(entries)

    def forget(self, part: int) -> None:
        """Drop a part found corrupt: its rows leave the index, its file goes."""
        self.store.drop(part)

    def quiet(self) -> None:
        """This shelf's rows are read through: no line says they are kept (``NodeStore.quiet``)."""
        self.store.quiet(self)

    # -- writing -------------------------------------------------------------------------------------
    def put(self, rows: Sequence[int], cols: Mapping[str, Sequence[Any]]) -> bool:
        """Write ``rows`` (the dataset's row numbers; their values per column key) as one part. False where the
        store did not keep them (over its limit, the disk at its margin or refusing, the shelf evicted);
        ``Unkeepable`` where a value cannot be kept exactly. Rows another process wrote meanwhile keep that
        process's copy."""
        bufs: list[bytes | memoryview] = []
        meta: list[tuple[str, int, int, int, int, str]] = []
        off = 0
        for col, values in cols.items():
            for r, v in zip(rows, values, strict=True):
                data, how = encode(v)
                n = data.nbytes if isinstance(data, memoryview) else len(data)
                meta.append((col, int(r), off, n, crc32(data), how))
                bufs.append(data)
                off += n
        store = self.store
        if self.off or store.no_room is not None:
            return False
        part = store.reserve(self.id, off, len(meta))
        if part is None:
            return False
        try:
            store.parts.write(part, bufs)
        except OSError as exc:
            store.drop(part)
            store.failed(exc)
            return False
        try:
            with store.transaction() as db:
                row = db.execute("SELECT bytes FROM parts WHERE id = ?", (part,)).fetchone()
                kept = row is not None  # (else its shelf was evicted: the part is no one's)
                if kept:
                    before = db.total_changes
                    db.executemany(
                        "INSERT OR IGNORE INTO entries VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        [(self.id, c, r, part, o, n, crc, how) for c, r, o, n, crc, how in meta],
                    )
                    if db.total_changes == before:  # every row was written by another process meanwhile
                        db.execute("DELETE FROM parts WHERE id = ?", (part,))
                        Index.add_used(db, -row[0])
                        part_kept = False
                    else:
                        db.execute("UPDATE parts SET done = 1 WHERE id = ?", (part,))
                        part_kept = True
        except sqlite3.Error as exc:
            store.drop(part)
            store.failed(exc)
            return False
        if not kept or not part_kept:
            store.parts.unlink([part])
        if kept:
            store.announce(self)
        return kept

    # -- one fetch per node --------------------------------------------------------------------------
    def claim(self, bins: Sequence[int]) -> str | None:
        """The node-wide claim of every bin of ``bins`` for a fetch, all or none in one step (so that two
        fetches over overlapping runs of bins never both go ahead, and never wait on each other): its
        holder's name (for ``unclaim``), or None while another fetch of a live process holds one of them."""
        me, now = owner(next(_claims) + 1), time.time()
        if self.off:
            return me
        try:
            with self.store.transaction() as db:
                for b in bins:
                    row = db.execute(
                        "SELECT owner, since FROM claims WHERE shelf = ? AND bin = ?", (self.id, b)
                    ).fetchone()
                    if row is not None and alive(row[0]) is not False:
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
        if self.off:
            return
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


__all__ = ["BIN", "CLAIM_PATIENCE_S", "Shelf", "Store", "alive", "owner"]
