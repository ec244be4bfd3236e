"""Exact epochs under the clients training code really uses: DataLoader workers (fork and spawn,
persistent or not), torchdata's StatefulDataLoader, a gloo process group, and errors crossing processes.

Each test asserts the exact batches (or the multiset of sample indices) of each epoch, or the exact
exception; none of them can pass by yielding less.
"""

from __future__ import annotations

import functools
import http.server
import io
import json
import logging
import os
import pickle
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import deeplake
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image
from torch.utils.data import DataLoader

import asyncload
from asyncload import (
    AsyncIterableDataset,
    AsyncLoader,
    ConfigError,
    DeepLakeSource,
    EpochSampler,
    ObjectStoreSource,
    ReadError,
)
from asyncload.errors import CollateError, RemoteError, read_error
from asyncload.sources.stores.http import HTTPStatusError
from asyncload.sources.stores.probe import S3AccessError, S3BucketNotFoundError, S3EndpointError
from asyncload.sources.stores.retry import GiveUp

from .conftest import ROWS, WORKER_START, shuffled
from .remote_fixtures import serving
from .test_torch import _free_port, batch_indices

pytestmark = pytest.mark.timeout(240)

HTTP_ROWS = 40
MISSING = "a-missing-stem"


# -- a real HTTP server on loopback ------------------------------------------------------------------
@pytest.fixture(scope="module")
def http_images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` serving ``images/NNN.png`` for 40 rows; row ``i`` is filled with ``i``."""
    root = tmp_path_factory.mktemp("http")
    (root / "images").mkdir()
    for i in range(HTTP_ROWS):
        Image.fromarray(np.full((8, 8, 3), i, np.uint8)).save(root / "images" / f"{i:03d}.png")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    with serving(
        http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    ) as url:
        yield url


def stems(missing_at: int | None = None) -> list[str]:
    rows = [f"{i:03d}" for i in range(HTTP_ROWS)]
    if missing_at is not None:
        rows[missing_at] = MISSING
    return rows


# -- errors cross process boundaries -------------------------------------------------------------------
def _errors() -> list[BaseException]:
    cause = FileNotFoundError(f"GET http://h/images/{MISSING}.png: HTTP 404")
    give_up = GiveUp("GET http://h/k", 3, HTTPStatusError(503, "Slow Down", code="SlowDown"), permanent=False)
    out: list[BaseException] = [
        read_error("http://h", "images", [20, 21], cause),
        read_error("s3://b/p", "masks", list(range(40)), KeyError("chunk 7")),
        read_error("s3://b/p", None, [3], give_up),
        read_error("file:///d", "images", [1], RuntimeError("decoder")),
        give_up,
    ]
    for cls in (
        asyncload.AsyncLoadError, ConfigError, asyncload.SourceError, asyncload.DatasetNotFoundError,
        asyncload.ColumnNotFoundError, ReadError, asyncload.WorkerError, CollateError, RemoteError,
        S3EndpointError, S3AccessError, S3BucketNotFoundError,
    ):  # fmt: skip
        err = cls(f"{cls.__name__}: what went wrong, naming s3://b/p")
        err.__cause__ = OSError(5, "the cause")
        out.append(err)
    return out


@pytest.mark.parametrize("exc", _errors(), ids=lambda e: type(e).__name__)
def test_every_error_survives_pickle_with_its_types_message_and_cause(exc: BaseException) -> None:
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    for base in type(exc).__mro__:  # a ReadError[FileNotFoundError] is still both
        assert isinstance(back, base)
    if exc.__cause__ is not None:
        assert type(back.__cause__) is type(exc.__cause__) and str(back.__cause__) == str(exc.__cause__)
    if isinstance(exc, ReadError):
        assert (back.source, back.column, back.indices) == (exc.source, exc.column, exc.indices)


def _read_to_error(dl: DataLoader) -> tuple[list[int], BaseException]:
    """The indices a DataLoader yielded before an error, and the error (``AssertionError`` where none came).
    Its traceback is dropped: torch re-raises a worker's error from a frame that the traceback holds, a
    reference cycle that would leave the DataLoader's iterator to the cyclic collector, which finalizes the
    iterator's queues before the iterator: its workers then never get their stop signal and are killed
    after 5 s each (10 s of every such test's teardown)."""
    seen: list[int] = []
    try:
        for b in dl:
            seen += b["index"].tolist()
    except Exception as exc:  # noqa: BLE001 - the test names the type it expects
        return seen, exc.with_traceback(None)
    raise AssertionError(f"the epoch ended without an error after {len(seen)} samples")


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_failed_read_in_a_worker_reaches_the_training_loop(http_images: str, context: str) -> None:
    """Batch 5 (rows 20..23) holds a missing object: batches 0..4 arrive, then the typed error, naming
    the URL, the key and the rows; never a silently short epoch."""
    src = ObjectStoreSource(http_images, columns=("images",), manifest=stems(missing_at=21))
    ds = AsyncIterableDataset(src, batch_size=4)
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    seen, err = _read_to_error(dl)
    assert seen == list(range(20))
    assert isinstance(err, ReadError) and isinstance(err, FileNotFoundError)
    msg = str(err)
    assert f"reading column 'images' of {http_images} at indices [" in msg and "21" in msg
    assert f"images/{MISSING}.png" in msg and "404" in msg


class _Unpicklable(Exception):
    """Defined at module level but made unpicklable: its __init__ wants an argument args do not hold."""

    def __init__(self, index: int, *, why: str) -> None:
        super().__init__(f"sample {index} is bad: {why}")


def _bad_transform(sample: dict) -> dict:
    if sample["index"] == 9:
        raise _Unpicklable(9, why="a user transform failed")
    return sample


def test_an_unpicklable_error_in_a_worker_arrives_as_remote_error(http_images: str) -> None:
    ds = AsyncIterableDataset(
        ObjectStoreSource(http_images, columns=("images",), manifest=stems()), batch_size=4, transform=_bad_transform
    )
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
    seen, err = _read_to_error(dl)
    assert seen == list(range(8))
    assert isinstance(err, RemoteError)
    assert "tests.test_clients._Unpicklable: sample 9 is bad: a user transform failed" in str(err)


# -- persistent workers follow set_epoch and load_state_dict -------------------------------------------
def _persistent(kind: str, seg_url: str, http_url: str) -> tuple[AsyncIterableDataset, DataLoader, EpochSampler]:
    """Fork workers read the HTTP store (fork-safe); spawn workers read Deep Lake, whose runtime does not
    survive a fork of a process that opened a dataset (README: use spawn with Deep Lake)."""
    if kind == "fork":
        src, rows, bs = ObjectStoreSource(http_url, columns=("images",), manifest=stems()), HTTP_ROWS, 4
    else:
        src, rows, bs = DeepLakeSource(seg_url), ROWS, 16
    ds = AsyncIterableDataset(src, batch_size=bs, shuffle=True, seed=7, concurrency=16)
    dl = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context=kind)
    return ds, dl, shuffled(rows, bs, 7, src.block_rows)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_persistent_workers_follow_set_epoch_and_load_state_dict(seg_url: str, http_images: str, context: str) -> None:
    ds, dl, plan = _persistent(context, seg_url, http_images)
    orders = []
    for e in range(3):
        ds.set_epoch(e)
        got = batch_indices(dl)
        assert got == plan.batches(e), f"epoch {e}"
        orders.append(got)
        if e == 0:
            pids = sorted(w.pid for w in dl._iterator._workers)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert sorted(w.pid for w in dl._iterator._workers) == pids  # the same (persistent) workers throughout

    # Interrupt epoch 4 after 5 batches, then resume it through the same persistent workers.
    ds.set_epoch(4)
    it = iter(dl)
    taken = [next(it)["index"].tolist() for _ in range(5)]
    ds.load_state_dict(ds.state_dict(batches_consumed=5))
    rest = batch_indices(dl)
    assert taken + rest == plan.batches(4)
    ds.set_epoch(5)
    assert batch_indices(dl) == plan.batches(5)


# -- torchdata's StatefulDataLoader --------------------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 1, 2])
def test_stateful_dataloader_resumes_mid_epoch_exactly(seg_url: str, workers: int) -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    plan = shuffled(ROWS, 16, 3)

    def make() -> tuple[AsyncIterableDataset, StatefulDataLoader]:
        ds = AsyncIterableDataset(DeepLakeSource(seg_url), batch_size=16, shuffle=True, seed=3, concurrency=16)
        ds.set_epoch(1)
        ctx = WORKER_START if workers else None
        return ds, StatefulDataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context=ctx)

    for k in (5, len(plan.batches(1))):
        _, first = make()
        it = iter(first)
        taken = [next(it)["index"].tolist() for _ in range(k)]
        buf = io.BytesIO()
        torch.save(first.state_dict(), buf)  # a checkpoint is written to disk, not kept in memory
        del it, first
        ds, second = make()
        second.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
        rest = batch_indices(second)
        assert taken + rest == plan.batches(1), f"saved after {k} batches"
        ds.set_epoch(2)  # the next epoch is a whole one, in its own order
        assert batch_indices(second) == plan.batches(2)


def test_stateful_state_without_a_live_iterator_says_what_to_do(seg_url: str) -> None:
    ds = AsyncIterableDataset(DeepLakeSource(seg_url), batch_size=16)
    with pytest.raises(ConfigError, match="pass batches_consumed=<steps taken this epoch>, or use torchdata"):
        ds.state_dict()


def test_adapter_without_workers_resumes_through_the_shared_helper(seg_url: str) -> None:
    from .resume import check_resume

    check_resume(
        lambda: AsyncIterableDataset(DeepLakeSource(seg_url), batch_size=32, shuffle=True, seed=9, concurrency=16),
        in_order=True,
    )


class _AdapterInStatefulWorkers:
    """The torch adapter read by StatefulDataLoader's persistent workers, driven as ``check_resume``
    drives every other epoch shape (the loader's state is the DataLoader's, as a training loop saves it)."""

    def __init__(self, url: str) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.ds = AsyncIterableDataset(DeepLakeSource(url), batch_size=32, shuffle=True, seed=9, concurrency=16)
        self.dl = StatefulDataLoader(
            self.ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START, persistent_workers=True
        )

    def set_epoch(self, epoch: int) -> None:
        self.ds.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self.dl.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dl.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        yield from self.dl


@pytest.mark.timeout(400)
def test_adapter_in_stateful_dataloader_workers_resumes_through_the_shared_helper(seg_url: str) -> None:
    from .resume import check_resume

    check_resume(lambda: _AdapterInStatefulWorkers(seg_url), in_order=True, epochs=1, finished_restarts=True)


# -- AsyncLoader under torch.distributed -----------------------------------------------------------------
def _loader_rank_main(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    logging.getLogger("asyncload").addHandler(handler)
    logging.getLogger("asyncload").setLevel(logging.INFO)
    try:
        loader = AsyncLoader(DeepLakeSource(url), batch_size=8, shuffle=True, seed=11, concurrency=16)
        loader.set_epoch(1)
        batches = batch_indices(loader)
        t = torch.tensor([len(batches)])
        dist.all_reduce(t)
        whole = batch_indices(AsyncLoader(DeepLakeSource(url), batch_size=8, rank=0, world_size=1, concurrency=16))
        result = {"batches": batches, "total": int(t.item()), "whole": sum(len(b) for b in whole), "log": records}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_asyncloader_in_a_process_group_reads_its_rank_share(seg_url: str, tmp_path: Path) -> None:
    world = 2
    mp.start_processes(
        _loader_rank_main, args=(world, _free_port(), seg_url, str(tmp_path)), nprocs=world, start_method="spawn"
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    order = shuffled(ROWS, 8, 11).order(1).tolist()
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == 13 and ranks[0]["total"] == 26
    seen = Counter(i for r in ranks for b in r["batches"] for i in b)
    assert set(seen) == set(range(ROWS)) and [i for i, c in seen.items() if c > 1] == [order[0]]  # one pad
    assert ranks[0]["batches"][0] == order[:8] and ranks[1]["batches"][0] == order[102:110]
    assert ranks[0]["whole"] == ranks[1]["whole"] == ROWS  # explicit rank/world_size override the group
    for r, res in enumerate(ranks):
        chose = [m for m in res["log"] if "from the torch.distributed process group" in m]
        assert chose == [
            f"asyncload: {seg_url} reads rank {r} of 2 (from the torch.distributed process group): 13 batches per epoch"
        ]


def test_rank_and_shard_together_are_refused(seg_url: str) -> None:
    with pytest.raises(ConfigError, match="pass either shard= or rank=/world_size=, not both"):
        AsyncLoader(DeepLakeSource(seg_url), shard=asyncload.Shard(), rank=0, world_size=1)
    with pytest.raises(ConfigError, match="rank=1 and world_size=None go together"):
        AsyncLoader(DeepLakeSource(seg_url), rank=1)


# -- the dataset's version is part of every resume state ----------------------------------------------------
def test_resume_refuses_another_version_of_the_same_length(tmp_path: Path) -> None:
    url = asyncload.make_dataset(str(tmp_path / "v"), 40, height=8, width=8, progress=False)
    loader = AsyncLoader(DeepLakeSource(url), batch_size=8, concurrency=4)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    rank_state = AsyncIterableDataset(DeepLakeSource(url), batch_size=8).state_dict(batches_consumed=1)
    before = state["plan"]["dataset_version"]
    assert rank_state["dataset_version"] == before

    ds = deeplake.open(url)
    ds["masks"][3] = np.zeros((8, 8), np.uint8)
    ds.commit("change one mask")
    after = deeplake.open_read_only(url).version
    assert after != before and len(deeplake.open_read_only(url)) == 40

    expected = (
        f"state was saved on version {before!r} of {url}, but it is now at version {after!r}: resuming would "
        f"read other samples under the same row numbers; open the saved version or start the epoch afresh"
    )
    with pytest.raises(ConfigError) as e:
        AsyncLoader(DeepLakeSource(url), batch_size=8).load_state_dict(state)
    assert str(e.value) == expected
    with pytest.raises(ConfigError) as e:
        AsyncIterableDataset(DeepLakeSource(url), batch_size=8).load_state_dict(rank_state)
    assert str(e.value) == expected


def test_object_store_version_is_a_digest_of_its_keys(http_images: str) -> None:
    a = AsyncLoader(ObjectStoreSource(http_images, columns=("images",), manifest=stems()), batch_size=8)
    b = AsyncLoader(ObjectStoreSource(http_images, columns=("images",), manifest=stems()[::-1]), batch_size=8)
    assert (
        a.source.version
        == AsyncLoader(
            ObjectStoreSource(http_images, columns=("images",), manifest=stems()), batch_size=8
        ).source.version
    )
    assert a.source.version != b.source.version and a.source.version.startswith("keys-sha256:")
    with pytest.raises(ConfigError, match="state was saved on version 'keys-sha256:"):
        b.load_state_dict(a.state_dict())


FORKED_SCRIPT = """
import json, sys
from torch.utils.data import DataLoader
from asyncload import AsyncIterableDataset, DeepLakeSource
ds = AsyncIterableDataset(DeepLakeSource(sys.argv[1]), batch_size=64, concurrency=8, **json.loads(sys.argv[2]))
print("deeplake imported", "deeplake" in sys.modules, file=sys.stderr, flush=True)
for ctx in ("fork", "spawn"):
    got = sorted(int(i) for b in DataLoader(ds, batch_size=None, num_workers=1, multiprocessing_context=ctx)
                 for i in b["index"])
    print(ctx, len(got), got == list(range(len(got))), file=sys.stderr, flush=True)
"""


@pytest.mark.parametrize("processes", ["auto", 0])
def test_forked_workers_are_warned_about_only_where_this_process_opened_deep_lake(seg_url: str, processes) -> None:
    """With a reader process (the default), the dataset is opened by a reader that stops once it has said
    what it opened: the training process holds no Deep Lake runtime to fork (nor imports Deep Lake), and a
    forked worker is no risk. With ``processes=0`` the training process opens it, and a forked worker, which
    would inherit Deep Lake's runtime, is warned about once."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FORKED_SCRIPT, seg_url, json.dumps({"processes": processes})],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert f"deeplake imported {processes == 0}" in lines
    assert f"fork {ROWS} True" in lines and f"spawn {ROWS} True" in lines
    warned = [i for i, line in enumerate(lines) if "was forked from a process that had opened" in line]
    if processes == 0:
        assert len(warned) == 1 and "multiprocessing_context='spawn' or 'forkserver'" in lines[warned[0]]
        assert warned[0] < lines.index(f"fork {ROWS} True") < lines.index(f"spawn {ROWS} True")  # spawn is not warned
    else:
        assert warned == [], lines
