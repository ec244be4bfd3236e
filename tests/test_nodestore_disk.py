"""A full disk (``nodestore.store``): the store never writes into the file system's margin, and what it holds
is still read when nothing more can be written. On a real, loop-mounted 16 MB ext4 file system (no blocks
reserved for root, so that root sees the disk full as a user would); skipped with the reason where mounting
is not allowed."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from asyncload import AsyncLoader, DeepLakeSource
from asyncload.nodestore.index import LOG_ROOM
from asyncload.nodestore.store import margin

from .conftest import ROWS, wait_no_loop_threads

pytestmark = pytest.mark.timeout(120)

OPTS = {"shuffle": True, "shuffle_block": 8, "shuffle_window": 32, "cache": True, "batch_size": 16}


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a loop file system needs root")
    if shutil.which("mkfs.ext4") is None:
        pytest.skip("mkfs.ext4 (e2fsprogs) is not installed")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with img.open("wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(img)], check=True, capture_output=True)
    out = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        pytest.skip(f"a loop file system cannot be mounted here: {out.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int) -> None:
    """A file that takes the file system's free space down to ``leave`` bytes (0: to the last block)."""
    with (path / f"filler-{len(list(path.glob('filler-*')))}").open("wb") as f:
        room = free(path) - leave
        if not leave:  # the file's own extent blocks come out of the same space: all of it would fail now and
            room -= 256 << 10  # then (ENOSPC, as the free space lay), so the last of it goes block by block
        if room > 0:
            os.posix_fallocate(f.fileno(), 0, room)
        if not leave:
            with contextlib.suppress(OSError):
                while True:  # (whatever fallocate left: block by block)
                    os.write(f.fileno(), b"\0" * 4096)
                    os.fsync(f.fileno())


def rows_stored(root: Path) -> int:
    with sqlite3.connect(f"file:{root / 'index.sqlite3'}?mode=ro", uri=True) as db:
        return db.execute("SELECT COUNT(DISTINCT row) FROM entries").fetchone()[0]


def check_exact(loader: AsyncLoader, seg_arrays) -> None:
    seen: Counter[int] = Counter()
    for b in loader:
        for k, i in enumerate(b["index"].tolist()):
            seen[i] += 1
            assert np.array_equal(b["images"][k].numpy(), seg_arrays["images"][i])
    assert seen == Counter(range(ROWS))


def test_a_full_disk_keeps_its_margin_and_the_rows_stored_are_still_read(small_fs, seg_url, seg_arrays, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="asyncload")
    root = small_fs / "store"
    keep = margin(os.statvfs(small_fs))
    fill(small_fs, keep + LOG_ROOM + 300_000)  # room for part of the dataset above the margin
    opts = {**OPTS, "cache_dir": str(root), "cache_limit": "1GB"}  # (the disk is the bound, not the limit)
    loader = AsyncLoader(DeepLakeSource(seg_url), **opts)
    check_exact(loader, seg_arrays)
    s = loader.stats()
    loader.close()
    # The ended epoch's lane finishes the store calls queued on it without the loop waiting (``runtime.loop``):
    # a part it wrote or dropped while the disk is filled below would move the free space the test sets.
    wait_no_loop_threads(30.0)
    stored = rows_stored(root)
    assert 0 < stored < ROWS and s["node_not_kept"] > 0
    assert free(small_fs) >= keep  # the margin is never written into
    # Another program fills the disk to the last block: the next loader writes nothing and reads every row
    # the store holds from it.
    fill(small_fs, 0)
    assert free(small_fs) == 0
    loader = AsyncLoader(DeepLakeSource(seg_url), **opts)
    check_exact(loader, seg_arrays)
    s = loader.stats()
    loader.close()
    assert s["node_hits"] == stored
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        f"asyncload: the disk under the node block store at {root} is full: no more rows are kept; the rows it "
        "holds are still read from it. Free space there, or set cache_dir elsewhere"
    ], said
