"""The ``Source`` contract (``sources/base``) as a user's subclass meets it.

- A subclass written before ``read`` took ``raw`` (``read(self, indices)``) reads exact rows wherever reads
  run: in this process, a reader process, fan-out workers, DataLoader workers, under ``RangeSource`` and
  ``MixedSource``; one written with ``raw`` is left as written and gets the columns to return as stored bytes.
- What names a dataset in a resume state: its URL, identity and version; a state of another is refused,
  naming what differs, and a state of the earlier format (the version alone) still loads.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, ConfigError, DeepLakeSource, MixedSource, RangeSource, Source
from asyncload.sources.base import Columns

from .conftest import ROWS, WORKER_START
from .sources import OldArraySource, OldCrashingSource


def _rows(batches) -> list[int]:
    return [int(i) for b in batches for i in b["index"]]


def _wrapped(cls: type) -> bool:
    return hasattr(cls.read, "__asyncload_without_raw__")


# -- sources written before ``raw`` --------------------------------------------------------------------------
def test_only_a_read_that_cannot_take_raw_is_wrapped() -> None:
    def make(read) -> type:  # noqa: ANN001
        return type("S", (OldArraySource,), {"read": read})

    async def old(self, indices): ...  # noqa: ANN001, ANN202
    async def own_third(self, indices, columns=None): ...  # noqa: ANN001, ANN202 - never passed one
    async def keyword(self, indices, **kw): ...  # noqa: ANN001, ANN202 - raw comes positionally
    async def new(self, indices, raw=frozenset()): ...  # noqa: ANN001, ANN202
    async def renamed(self, indices, stored): ...  # noqa: ANN001, ANN202 - required: the current contract
    async def star(self, *args): ...  # noqa: ANN001, ANN202

    assert [_wrapped(make(f)) for f in (old, own_third, keyword)] == [True] * 3
    assert [_wrapped(make(f)) for f in (new, renamed, star)] == [False] * 3
    assert make(new).read is new
    # A subclass of an old one that does not override read inherits the wrapped one, not wrapped again.
    sub = type("Sub", (OldArraySource,), {})
    assert sub.read is OldArraySource.read and OldArraySource.read.__asyncload_without_raw__.__name__ == "read"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("processes", [0, 2])
def test_an_old_plain_source_reads_exact_rows_here_and_in_fanout_workers(processes: int) -> None:
    with AsyncLoader(OldArraySource(50), batch_size=8, shuffle=True, seed=1, processes=processes) as loader:
        batches = list(loader)
    assert sorted(_rows(batches)) == list(range(50))
    for b in batches:
        assert np.asarray(b["x"]).tolist() == [[3 * i, 3 * i + 1, 3 * i + 2] for i in b["index"].tolist()]


@pytest.mark.timeout(120)
def test_an_old_plain_source_reads_exact_rows_in_two_dataloader_workers_and_in_a_mixture() -> None:
    ds = AsyncIterableDataset(OldArraySource(50), batch_size=8)
    batches = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START))
    assert sorted(_rows(batches)) == list(range(50))
    for b in batches:
        assert b["x"].tolist() == [[3 * i, 3 * i + 1, 3 * i + 2] for i in b["index"].tolist()]
    mix = MixedSource(
        {"a": OldArraySource(30, "memory://a"), "b": RangeSource(OldArraySource(40, "memory://b"), 10, 30)}
    )
    got = {(s, i): x for b in AsyncLoader(mix, batch_size=8, processes=0) for s, i, x in
           zip(b["source"].tolist(), b["index"].tolist(), np.asarray(b["x"]).tolist(), strict=True)}  # fmt: skip
    assert sorted(got) == [(0, i) for i in range(30)] + [(1, i) for i in range(10, 30)]
    assert all(x == [3 * i, 3 * i + 1, 3 * i + 2] for (_, i), x in got.items())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["reader", "fanout", "range", "dataloader"])
def test_an_old_crashing_source_loses_no_row(where: str, seg_url, seg_arrays, tmp_path: Path) -> None:
    """Old ``read`` in each place reads run, with a crash of the process that reads on two rows (each once):
    every row comes once with its own pixels, decoded by the source (raw ignored). Not in a DataLoader
    worker, which reads itself (it cannot start a reader process): a crash ends it (``test_isolation``)."""
    crash = set() if where == "dataloader" else {20, 130}
    src = OldCrashingSource(seg_url, crash, sig=signal.SIGSEGV, once_dir=str(tmp_path))
    rows = list(range(ROWS))
    if where == "dataloader":
        ds = AsyncIterableDataset(src, batch_size=8, shuffle=True, seed=2)
        batches = list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START))
    else:
        source = RangeSource(src, 16, 148) if where == "range" else src
        rows = list(range(16, 148)) if where == "range" else rows
        with AsyncLoader(source, 8, shuffle=True, seed=2, processes=2 if where == "fanout" else "auto") as loader:
            batches = list(loader)
            assert loader.processes == (2 if where == "fanout" else 1)
            assert loader.stats()["worker_restarts"] in (1, 2)  # both rows may be in flight at once
    assert sorted(_rows(batches)) == rows
    for b in batches:
        for j, i in enumerate(b["index"].tolist()):
            assert np.array_equal(np.asarray(b["images"][j]), seg_arrays["images"][i]), f"row {i}"
            assert np.array_equal(np.asarray(b["masks"][j]), seg_arrays["masks"][i]), f"row {i}"
    assert {p.name for p in tmp_path.glob("row-*")} == {f"row-{r}" for r in crash}  # each crashed a reader


class RawSeen(DeepLakeSource):
    """A source written with ``raw``: records the ``raw`` of each read (read in this process)."""

    seen: list[frozenset[str]] = []

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        RawSeen.seen.append(raw)
        return await super().read(indices, raw)


def test_a_source_written_with_raw_is_left_as_written_and_gets_raw(seg_url, seg_arrays) -> None:
    assert not _wrapped(RawSeen) and RawSeen.read is RawSeen.__dict__["read"]
    RawSeen.seen.clear()
    batches = list(AsyncLoader(RawSeen(seg_url), batch_size=16, processes=0))
    assert RawSeen.seen and set(RawSeen.seen) == {frozenset({"images", "masks"})}  # the decode stage's columns
    assert _rows(batches) == list(range(ROWS))
    assert np.array_equal(np.asarray(batches[1]["images"][0]), seg_arrays["images"][16])


# -- what names the data in a resume state -------------------------------------------------------------------
def _where(src: Source) -> dict:
    """Deep Lake read in a reader process (the default): an epoch closed with its reads in flight, in the
    pytest process, is where Deep Lake 4.7.4's segfault in ``Future.__await__`` struck (twice in one full
    run, in these tests); a user's source in this process."""
    return {} if isinstance(src, DeepLakeSource) else {"processes": 0}


def _state_after_one(src: Source, **kw) -> tuple[dict, dict]:  # noqa: ANN003
    """A loader's state and a rank state (``AsyncIterableDataset``), one batch taken."""
    loader = AsyncLoader(src, batch_size=8, **_where(src), **kw)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    loader.close()
    return state, AsyncIterableDataset(src, batch_size=8, **_where(src), **kw).state_dict(batches_consumed=1)


def test_a_state_names_url_identity_and_version(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    state, rank = _state_after_one(src)
    assert src.identity is not None and len(src.identity) == 32
    for plan in (state["plan"], rank["plan"]):
        named = (plan["dataset_url"], plan["dataset_identity"], plan["dataset_version"])
        assert named == (seg_url, src.identity, src.version)
    assert RangeSource(src, 0, 10).identity == src.identity
    assert OldArraySource(5).identity is None


def test_a_custom_source_without_version_is_told_apart_by_its_url() -> None:
    state, rank = _state_after_one(OldArraySource(48, "memory://a"))
    same = AsyncLoader(OldArraySource(48, "memory://a"), batch_size=8, processes=0)
    same.load_state_dict(state)  # the same URL: version and identity None alike, as before
    assert _rows(same) == list(range(8, 48))
    AsyncIterableDataset(OldArraySource(48, "memory://a"), batch_size=8).load_state_dict(rank)
    expected = (
        "state was saved on another dataset than memory://b (url 'memory://a' then, 'memory://b' now): resuming "
        "would read other samples under the same row numbers; load a state saved on this dataset or start the "
        "epoch afresh"
    )
    with pytest.raises(ConfigError) as e:
        AsyncLoader(OldArraySource(48, "memory://b"), batch_size=8).load_state_dict(state)
    assert str(e.value) == expected
    with pytest.raises(ConfigError) as e:
        AsyncIterableDataset(OldArraySource(48, "memory://b"), batch_size=8).load_state_dict(rank)
    assert str(e.value) == expected


def test_a_state_of_the_earlier_format_loads_on_the_same_version_and_no_other(seg_url) -> None:
    """States saved before the URL and identity were in them (the version alone) load as before."""
    src = DeepLakeSource(seg_url)
    state, rank = _state_after_one(src)
    drop = ("dataset_url", "dataset_identity")
    old = {**state, "plan": {k: v for k, v in state["plan"].items() if k not in drop}}
    old_rank = {**rank, "plan": {k: v for k, v in rank["plan"].items() if k not in drop}}
    loader = AsyncLoader(src, batch_size=8, **_where(src))
    loader.load_state_dict(old)
    assert _rows(loader) == list(range(8, ROWS))
    AsyncIterableDataset(src, batch_size=8, **_where(src)).load_state_dict(old_rank)
    other = {**old, "plan": {**old["plan"], "dataset_version": "0000000002m00000000"}}
    with pytest.raises(ConfigError, match="state was saved on version '0000000002m00000000' of "):
        loader.load_state_dict(other)
    loader.close()
