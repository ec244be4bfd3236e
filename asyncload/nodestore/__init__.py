"""The node block store: rows fetched from a remote store, kept on this machine's disk, private to the user.

Why: a segmentation model reads its dataset 50-200 times. Without a local copy every epoch pulls the whole
dataset again from the store, every DataLoader worker and fan-out process fetches its own rows of each
block, and rows fetched ahead of their turn sit in the heap. Here the first process of the node that needs
a block fetches it and writes it down; every other process, every later epoch and the next run of the job
read it from local disk. The read stage (``engine.blocks`` through ``engine.keeping``) is its only user.

Its files, each with one job:

- ``root``: where the store lives (``default_root``) and the check that makes it trustworthy: a directory
  of the user's, private, opened once and held as a descriptor; everything below opened relative to it,
  never through a link.
- ``index``: the node's one SQLite index (WAL), which every process reads and changes in short
  transactions: bytes used, which rows are present, claims on bins being fetched.
- ``parts``: the part files, written whole with ``O_EXCL``, read back value by value against a CRC32;
  what the index does not know swept at open.
- ``values``: a value as bytes and back, exactly; pickles authenticated with the user's key.
- ``store``: ``NodeStore``, the above put together: room and eviction within a limit that counts what the
  disk holds, a free-space margin, shelves in use, healing.
- ``shelf``: ``Shelf``, one dataset version's rows as a process looks them up, reads, writes and claims
  them before a fetch.

Keys name what shaped the bytes: a shelf is a dataset at one version (``Source.store_key``), an entry is a
row of a column (its name, stored bytes or decoded values, ``Source.value_tag``). Rows are the dataset's
own (``Source.row_ids``), so splits, queries and column sets of one dataset share them. The files are plain
(no mmap): rows read from them land in the page cache, which the kernel reclaims.
"""

from __future__ import annotations

from .index import FORMAT, Unreadable
from .parts import CorruptPart, Entry
from .root import NotPrivate, candidates, default_root, fs_type
from .shelf import BIN, CLAIM_PATIENCE_S, Shelf
from .store import DEFAULT_LIMIT_CAP, ENTRY_COST, NodeStore, open_shelf
from .values import Forged, Unkeepable, decode, encode, key_path, user_key

__all__ = [
    "BIN",
    "CLAIM_PATIENCE_S",
    "DEFAULT_LIMIT_CAP",
    "ENTRY_COST",
    "FORMAT",
    "CorruptPart",
    "Entry",
    "Forged",
    "NodeStore",
    "NotPrivate",
    "Shelf",
    "Unkeepable",
    "Unreadable",
    "candidates",
    "decode",
    "default_root",
    "encode",
    "fs_type",
    "key_path",
    "open_shelf",
    "user_key",
]
