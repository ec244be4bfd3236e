"""A ``Source`` of your own: a folder of ``.npy`` files, one per column, read by asyncload.

    python examples/custom_source.py        # writes a small folder in a temporary directory and reads it

docs/guides/writing-a-source.md walks through each part. The source is what asyncload needs from a store
(open it, count its rows, read some rows, say which data it is); everything else (batches, shuffling,
shards, DataLoader and fan-out workers, resume, decoding) is the loader's.

The folder this source reads::

    data/arrays/dataset.json     {"id": "<a uuid, new for every folder written>"}
    data/arrays/images.npy       uint8 [rows, H, W, 3]
    data/arrays/masks.npy        uint8 [rows, H, W]
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import pickle
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from asyncload import (
    AsyncLoader,
    ColumnNotFoundError,
    ConfigError,
    DatasetNotFoundError,
    ReadError,
    Source,
    SourceError,
)


class NpyFolderSource(Source[dict[str, np.ndarray]]):
    """Rows of ``<folder>/<column>.npy``: row ``i`` of each column is ``array[i]``.

    The instance is a description (a path and the columns): it is pickled to every worker, and each
    process opens the files itself (``_open``), memory-mapped, so no process reads rows it is not asked for.
    """

    def __init__(self, folder: str | os.PathLike[str], columns: Sequence[str] = ("images", "masks")) -> None:
        path = Path(folder).resolve()
        super().__init__(path.as_uri(), columns)  # the URL names the dataset in errors and resume states
        self.folder = str(path)

    def _open(self) -> dict[str, np.ndarray]:
        """Called once per process, on first use: open and check, raising errors that name what is wrong."""
        if not Path(self.folder, "dataset.json").is_file():
            raise DatasetNotFoundError(f"no dataset at {self.url}: dataset.json is missing")
        arrays = {}
        for col in self.columns:
            file = Path(self.folder, f"{col}.npy")
            if not file.is_file():
                have = sorted(p.stem for p in Path(self.folder).glob("*.npy"))
                raise ColumnNotFoundError(f"column {col!r} is not in {self.url} (its columns: {', '.join(have)})")
            arrays[col] = np.load(file, mmap_mode="r")
        if len({len(a) for a in arrays.values()}) != 1:
            lengths = {c: len(a) for c, a in arrays.items()}
            raise SourceError(f"the columns of {self.url} have different lengths: {lengths}")
        return arrays

    def _length(self, handle: dict[str, np.ndarray]) -> int:
        return len(handle[self.columns[0]])

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> dict[str, np.ndarray]:
        """Rows ``indices`` of every column, stacked. ``raw`` names columns the loader would rather get as
        stored bytes (it decodes JPEG and PNG itself); these arrays have no encoding, so ``raw`` is ignored
        and every column comes back as arrays, which the loader takes as they are. The copy out of the
        memory map touches the disk: it runs in a thread, so that the loop keeps other reads going."""
        return await asyncio.to_thread(self._gather, indices)

    def _gather(self, indices: list[int]) -> dict[str, np.ndarray]:
        handle = self.handle()  # this process's own (opened here on first use)
        out = {}
        for col in self.columns:
            try:
                out[col] = np.ascontiguousarray(handle[col][indices])
            except OSError as exc:  # a file truncated or gone under the map
                raise ReadError(
                    f"reading column {col!r} of {self.url} at rows {indices} failed: {exc}",
                    source=self.url, column=col, indices=indices,
                ) from exc  # fmt: skip
        return out

    def _version(self, handle: dict[str, np.ndarray]) -> str | None:
        """The files' sizes and modification times: a column rewritten is another version, so a resume state
        saved before is refused rather than read with other rows under its row numbers."""
        h = hashlib.sha256()
        for col in self.columns:
            st = os.stat(Path(self.folder, f"{col}.npy"))
            h.update(f"{col}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        return f"files-sha256:{h.hexdigest()[:16]}"

    def _identity(self, handle: dict[str, np.ndarray]) -> str | None:
        """The folder's id: a folder written again at the same path is another dataset, even where its
        files happen to have the old sizes and times."""
        return str(json.loads(Path(self.folder, "dataset.json").read_text())["id"])

    @property
    def local(self) -> bool:
        return True  # on this machine already: the node block store has nothing to keep


def write_folder(folder: str | os.PathLike[str], rows: int = 64, size: int = 24, seed: int = 0) -> Path:
    """A folder of ``rows`` random images and masks, with a new id."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    np.save(path / "images.npy", rng.integers(0, 256, (rows, size, size, 3), dtype=np.uint8))
    np.save(path / "masks.npy", rng.integers(0, 5, (rows, size, size), dtype=np.uint8))
    (path / "dataset.json").write_text(json.dumps({"id": uuid.uuid4().hex}))
    return path


def check(folder: Path) -> None:
    """How to test a source: exact rows from ``read``, from a pickled copy (what every worker gets) and
    through the loader (in this process and in 2 fan-out workers: every row once), clear errors, and
    a resume state refused on another dataset."""
    src = NpyFolderSource(folder)
    images, masks = np.load(folder / "images.npy"), np.load(folder / "masks.npy")
    assert len(src) == len(images)

    got = asyncio.run(src.read([5, 2]))
    assert np.array_equal(got["images"], images[[5, 2]]) and np.array_equal(got["masks"], masks[[5, 2]])
    copy = pickle.loads(pickle.dumps(src))  # no handle travels: the copy opens its own
    assert np.array_equal(asyncio.run(copy.read([7]))["masks"], masks[[7]])

    for processes in (0, 2):
        with AsyncLoader(src, batch_size=16, shuffle=True, seed=0, processes=processes) as loader:
            seen = []
            for batch in loader:
                rows = batch["index"].tolist()
                assert np.array_equal(batch["images"].numpy(), images[rows]), rows
                seen += rows
        assert sorted(seen) == list(range(len(images))), processes

    for bad, error in ((NpyFolderSource(folder / "nowhere"), DatasetNotFoundError),
                       (NpyFolderSource(folder, columns=("labels",)), ColumnNotFoundError)):  # fmt: skip
        try:
            bad.open()
        except error as exc:
            print(f"{type(exc).__name__}: {exc}")
        else:
            raise AssertionError(f"{bad} opened")

    loader = AsyncLoader(src, batch_size=16, processes=0)
    state = loader.state_dict()
    write_folder(folder, rows=len(images), seed=1)  # written again: same path and length, a new id
    try:
        AsyncLoader(NpyFolderSource(folder), batch_size=16, processes=0).load_state_dict(state)
    except ConfigError as exc:
        print(f"refused: {exc}")
    else:
        raise AssertionError("a state of the old folder resumed on the new one")


if __name__ == "__main__":  # spawned workers import this file too: only the main process runs this
    with tempfile.TemporaryDirectory() as tmp:
        data = write_folder(Path(tmp) / "arrays")
        with AsyncLoader(NpyFolderSource(data), batch_size=16, shuffle=True, seed=0) as loader:
            batch = next(iter(loader))
        print({k: (tuple(v.shape), str(v.dtype)) for k, v in batch.items()})
        check(data)
        print("NpyFolderSource: every check passed")
