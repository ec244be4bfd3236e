"""``DeepLakeSource`` (``sources/deeplake.py``): what it tells the loader about the dataset (image
columns, block rows, a pickled copy that reopens the same rows), and Deep Lake versions (tag, branch,
commit) and TQL query results as the rows to load: the right data, ``"index"`` naming dataset rows,
exactly once across workers and resumes, and clear errors."""

from __future__ import annotations

import os
import pickle
from collections import Counter
from pathlib import Path

import deeplake
import numpy as np
import pytest
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, ConfigError, DeepLakeSource, SourceError, make_dataset

from .conftest import WORKER_START
from .resume import check_resume

pytestmark = pytest.mark.timeout(180)

ROWS = 60


@pytest.fixture(scope="module")
def versioned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """60 rows labelled ``i % 4`` (tag ``v1``, commit ``c1``, branch ``b1``), then 20 more on main."""
    url = make_dataset(str(tmp_path_factory.mktemp("views") / "ds"), ROWS, height=8, width=8, progress=False)
    ds = deeplake.open(url)
    ds.add_column("label", deeplake.types.Int32())
    ds["label"][0:ROWS] = (np.arange(ROWS) % 4).astype(np.int32)
    ds.commit("labels")
    c1 = ds.version
    ds.tag("v1")
    ds.branch("b1")
    more = deeplake.open_read_only(url)
    ds.append({
        "images": np.stack([np.asarray(more[i]["images"]) for i in range(20)]),
        "masks": np.stack([np.asarray(more[i]["masks"]) for i in range(20)]),
        "label": np.full(20, 9, np.int32),
    })  # fmt: skip
    ds.commit("20 more rows")
    return {"url": url, "c1": c1}


def indices(loader) -> list[int]:
    return [i for b in loader for i in b["index"].tolist()]


def test_the_source_names_its_image_columns_and_its_block_rows(seg_url: str) -> None:
    src = DeepLakeSource(seg_url)
    roles = {name: col.role for name, col in src.image_columns().items()}
    assert roles == {"images": "image", "masks": "mask"}
    assert len(src) == 203 and src.block_rows == 64  # a shuffled epoch keeps 64 contiguous rows together


def test_a_query_reads_row_by_row_in_a_shuffle(versioned: dict[str, str]) -> None:
    """A query's rows are scattered over the dataset: blocks of them would not be contiguous in storage."""
    src = DeepLakeSource(versioned["url"], query="SELECT * WHERE label == 1", version="v1")
    assert src.block_rows == 1 and len(src) == ROWS // 4


def test_a_pickled_source_reopens_the_same_rows(seg_url: str, seg_arrays: dict[str, np.ndarray]) -> None:
    """Reader processes, fan-out workers and DataLoader workers get the source pickled and reopen it."""
    copy = pickle.loads(pickle.dumps(DeepLakeSource(seg_url, columns=("masks",))))
    got = next(iter(AsyncLoader(copy, batch_size=8, processes=0)))
    assert sorted(got) == ["index", "masks"]
    assert np.array_equal(got["masks"].numpy(), seg_arrays["masks"][:8])


@pytest.mark.parametrize("version", ["v1", "b1", "c1"])
def test_a_pinned_version_reads_that_version(versioned: dict[str, str], version: str) -> None:
    spec = versioned["c1"] if version == "c1" else version
    loader = AsyncLoader(DeepLakeSource(versioned["url"], version=spec), batch_size=16, concurrency=8)
    assert indices(loader) == list(range(ROWS))
    if version == "b1":  # a branch numbers its commits from its own start: the version names it
        assert loader.source.version.startswith("b1:")
    else:
        assert loader.source.version == versioned["c1"]
    head = AsyncLoader(DeepLakeSource(versioned["url"]), batch_size=16, concurrency=8)
    assert len(head.source) == ROWS + 20 and head.source.version != versioned["c1"]


def test_an_unknown_version_names_the_tags_and_branches(versioned: dict[str, str]) -> None:
    with pytest.raises(SourceError) as e:
        AsyncLoader(DeepLakeSource(versioned["url"], version="v9"))
    assert str(e.value) == (
        f"version='v9' is not a tag, branch or commit of Deep Lake dataset {versioned['url']} "
        f"(tags: v1; branches: b1, main)"
    )


def test_query_rows_are_named_by_dataset_row_and_read_right(versioned: dict[str, str]) -> None:
    src = DeepLakeSource(versioned["url"], columns=("images", "label"), query="SELECT * WHERE label = 2 ORDER BY label")
    batches = list(AsyncLoader(src, batch_size=4, concurrency=8))
    assert [i for b in batches for i in b["index"].tolist()] == list(range(2, ROWS, 4))
    assert all((b["label"] == 2).all() for b in batches)
    head = deeplake.open_read_only(versioned["url"])
    for b in batches:
        for j, i in enumerate(b["index"].tolist()):
            assert np.array_equal(b["images"][j].numpy(), np.asarray(head[i]["images"]))


def test_a_sampled_query_is_the_same_rows_in_every_worker(versioned: dict[str, str]) -> None:
    query = "SELECT * SAMPLE BY MAX_WEIGHT(label == 1: 1, label != 1: 0) REPLACE True LIMIT 40"
    src = DeepLakeSource(versioned["url"], query=query)
    ds = AsyncIterableDataset(src, batch_size=8, shuffle=True, seed=2, concurrency=8)
    rows = src.row_ids(list(range(len(src))))  # drawn once, in this process
    assert len(rows) == 40 and set(rows) <= set(range(1, ROWS, 4)) and len(set(rows)) < 40  # with replacement
    for e in range(2):
        ds.set_epoch(e)
        got = indices(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START))
        assert Counter(got) == Counter(rows), f"epoch {e}"


def test_a_sampled_query_read_in_a_reader_process_gives_the_rows_the_loader_names(versioned: dict[str, str]) -> None:
    """With the default isolation, the reader process reads the rows the training process drew, not rows
    of a query it ran again: each batch's pixels are those of the rows its ``"index"`` names."""
    query = "SELECT * SAMPLE BY MAX_WEIGHT(label == 1: 1, label != 1: 0) REPLACE True LIMIT 40"
    loader = AsyncLoader(DeepLakeSource(versioned["url"], query=query), batch_size=8, concurrency=8)
    assert loader.processes == 1 and loader._isolated is not None
    rows = loader.source.row_ids(list(range(len(loader.source))))
    head = deeplake.open_read_only(versioned["url"])
    got = []
    for e in range(2):
        loader.set_epoch(e)
        for b in loader:
            for j, i in enumerate(b["index"].tolist()):
                assert np.array_equal(b["images"][j].numpy(), np.asarray(head[i]["images"])), f"row {i}"
                got.append(i)
    loader.close()
    assert Counter(got) == Counter(rows * 2)


def test_a_sampled_query_is_drawn_by_the_first_reader_alone_and_kept_by_its_replacement(
    versioned: dict[str, str], tmp_path: Path
) -> None:
    """The training process does not open the dataset: the reader runs the query and its description names
    the rows. A reader killed mid-epoch is replaced by one given those rows, not one that samples again: every
    batch's pixels are those of the rows its ``"index"`` names, and every row the loader names comes once."""
    from .sources import CrashingSource

    query = "SELECT * SAMPLE BY MAX_WEIGHT(label == 1: 1, label != 1: 0) REPLACE True LIMIT 40"
    src = CrashingSource(versioned["url"], {5, 29}, once_dir=str(tmp_path), query=query)
    with AsyncLoader(src, batch_size=8, concurrency=8, shuffle=True, seed=4) as loader:
        assert loader._isolated is not None and loader.source is src
        assert src._handle_obj is None  # never opened here
        rows = src.row_ids(list(range(len(src))))
        assert len(rows) == 40 and set(rows) <= set(range(1, ROWS, 4))
        head = deeplake.open_read_only(versioned["url"])
        got = []
        for b in loader:
            for j, i in enumerate(b["index"].tolist()):
                assert np.array_equal(b["images"][j].numpy(), np.asarray(head[i]["images"])), f"row {i}"
                got.append(i)
        assert loader.stats()["worker_restarts"] == 2
        assert src._handle_obj is None
    assert Counter(got) == Counter(rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["row-29", "row-5"]  # both readers that read them died


def test_resume_over_a_query_is_exact_and_bound_to_its_rows(versioned: dict[str, str]) -> None:
    url = versioned["url"]
    check_resume(
        lambda: AsyncLoader(DeepLakeSource(url, query="SELECT * WHERE label < 3"), batch_size=8, shuffle=True, seed=1),
        in_order=True,
    )
    a = AsyncLoader(DeepLakeSource(url, query="SELECT * WHERE label = 1"), batch_size=8)
    b = AsyncLoader(DeepLakeSource(url, query="SELECT * WHERE label = 2"), batch_size=8)
    assert len(a.source) == len(b.source) == ROWS // 4
    with pytest.raises(ConfigError, match=r"state was saved on version '\w+\+rows-sha256:"):
        b.load_state_dict(a.state_dict())


def _one_batch_states(url: str) -> tuple[dict, dict]:
    loader = AsyncLoader(DeepLakeSource(url), batch_size=8, processes=0)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    it.close()
    return state, AsyncIterableDataset(DeepLakeSource(url), batch_size=8).state_dict(batches_consumed=1)


def test_a_dataset_created_again_at_the_same_url_refuses_the_old_ones_state(tmp_path: Path) -> None:
    """Commit ids count from a dataset's start: the new dataset has the old one's length and commit id, and
    only its ``ds.id`` (the source's ``identity``) tells them apart; also the node block store's key."""
    path = str(tmp_path / "ds")
    url = make_dataset(path, ROWS, height=8, width=8, progress=False)
    before = DeepLakeSource(url).open()
    old = (len(before), before.version, before.identity, before.store_key)
    state, rank = _one_batch_states(url)
    deeplake.delete(url)
    assert make_dataset(path, ROWS, height=8, width=8, seed=1, progress=False) == url
    after = DeepLakeSource(url)
    assert (len(after), after.version) == old[:2] == (ROWS, "0000000001m00000000")
    assert after.identity == deeplake.open_read_only(url).id != old[2]
    assert after.store_key != old[3]
    expected = (
        f"state was saved on another dataset than {url} (identity {old[2]!r} then, {after.identity!r} "
        f"now): resuming would read other samples under the same row numbers; load a state saved on this "
        f"dataset or start the epoch afresh"
    )
    with pytest.raises(ConfigError) as e:
        AsyncLoader(DeepLakeSource(url), batch_size=8, processes=0).load_state_dict(state)
    assert str(e.value) == expected
    with pytest.raises(ConfigError) as e:
        AsyncIterableDataset(DeepLakeSource(url), batch_size=8).load_state_dict(rank)
    assert str(e.value) == expected


def test_a_state_of_a_copy_at_another_url_is_refused_naming_url_and_identity(tmp_path: Path) -> None:
    a = make_dataset(str(tmp_path / "a"), ROWS, height=8, width=8, progress=False)
    b = make_dataset(str(tmp_path / "b"), ROWS, height=8, width=8, progress=False)
    assert DeepLakeSource(a).version == DeepLakeSource(b).version  # same length, same commit id
    state, _ = _one_batch_states(a)
    with pytest.raises(
        ConfigError, match=rf"another dataset than {b} \(url '{a}' then, '{b}' now; identity '\w+' then"
    ):
        AsyncLoader(DeepLakeSource(b), batch_size=8, processes=0).load_state_dict(state)


@pytest.mark.parametrize(
    "query", ["DELETE FROM x", 'SELECT * FROM "s3://other" WHERE a = 1'], ids=["not-select", "from"]
)
def test_a_query_that_is_not_a_select_on_this_dataset_is_refused(query: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is not allowed: a TQL query on this dataset"):
        DeepLakeSource(tmp_path, query=query)


def test_a_query_that_selects_nothing_says_so(versioned: dict[str, str]) -> None:
    with pytest.raises(SourceError, match="selects no rows"):
        AsyncLoader(DeepLakeSource(versioned["url"], query="SELECT * WHERE label = 7"))


def test_a_ready_view_is_refused_naming_the_query_form(versioned: dict[str, str]) -> None:
    view = deeplake.open_read_only(versioned["url"]).query("SELECT * WHERE label = 1")
    with pytest.raises(ConfigError, match=r"url=DatasetView is not allowed: .* as its TQL text \(query="):
        DeepLakeSource(view)


@pytest.fixture(scope="module")
def empty_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Deep Lake dataset with the usual columns and no rows."""
    url = str(tmp_path_factory.mktemp("empty") / "ds")
    ds = deeplake.create(url)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="png"))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="lz4"))
    ds.commit("empty")
    return url


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("processes", [0, "auto", 2])
def test_an_empty_dataset_reads_as_zero_batches_shuffled_or_not(empty_url: str, shuffle: bool, processes) -> None:
    """Zero batches, every epoch, in-process, through the reader process and from fan-out workers (a
    shuffled one used to raise ``ZeroDivisionError`` in ``sampler.block_order``)."""
    with AsyncLoader(DeepLakeSource(empty_url), 4, shuffle=shuffle, processes=processes) as loader:
        assert len(loader) == 0
        for epoch in range(2):
            loader.set_epoch(epoch)
            assert list(loader) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shuffle", [False, True])
def test_an_empty_dataset_under_dataloader_workers_reads_as_zero_batches(empty_url: str, shuffle: bool) -> None:
    ds = AsyncIterableDataset(DeepLakeSource(empty_url), 4, shuffle=shuffle)
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)
    assert list(dl) == []


# -- a query under torch.distributed: every rank reads the same rows, or every rank fails -----------------
SAMPLED = "SELECT * SAMPLE BY MAX_WEIGHT(label == 1: 1, label != 1: 0) REPLACE True LIMIT 40"
FILTERED = "SELECT * WHERE label = 2 ORDER BY asyncload_row"  # deterministic: a filter, a total order


def _query_rank_main(rank: int, world: int, port: int, url: str, out_dir: str) -> None:
    import json

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result: dict[str, object] = {}
    try:
        for name, make in (
            ("loader", lambda q: AsyncLoader(DeepLakeSource(url, query=q), batch_size=4, concurrency=4)),
            ("dataset", lambda q: AsyncIterableDataset(DeepLakeSource(url, query=q), batch_size=4)),
        ):
            try:
                make(SAMPLED)
                result[f"{name}_sampled"] = "no error"
            except Exception as exc:  # noqa: BLE001 - reported to the test
                result[f"{name}_sampled"] = [type(exc).__name__, str(exc), isinstance(exc, ConfigError)]
        loader = AsyncLoader(DeepLakeSource(url, query=FILTERED), batch_size=4, concurrency=4)
        result["filtered"] = [i for b in loader for i in b["index"].tolist()]
        loader.close()
        # The documented way to a sampled query under torchrun: opened on rank 0, sent to the others.
        box = [DeepLakeSource(url, query=SAMPLED).open() if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        loader = AsyncLoader(box[0], batch_size=4, concurrency=4, remainder="drop")
        result["sent_rows"] = box[0].row_ids(list(range(len(box[0]))))
        result["sent"] = [i for b in loader for i in b["index"].tolist()]
        loader.close()
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_a_sampled_query_under_two_real_ranks_fails_on_both_naming_each_ranks_rows(
    versioned: dict[str, str], tmp_path: Path
) -> None:
    """Two gloo ranks (spawned) each run a ``SAMPLE BY`` query in their own open: their rows differ, so
    each would read its share of other rows (some twice, some never). Both ranks raise
    ``RanksDisagreeError`` (a ``ConfigError``) naming each rank's rows digest, from ``AsyncLoader`` and from
    ``AsyncIterableDataset``, instead of reading; a deterministic query reads every row once across them."""
    import json

    import torch.multiprocessing as mp

    from .test_torch import _free_port

    world = 2
    mp.start_processes(_query_rank_main, args=(world, _free_port(), versioned["url"], str(tmp_path)), nprocs=world,
                       start_method="spawn")  # fmt: skip
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for name in ("loader", "dataset"):
        texts = [r[f"{name}_sampled"] for r in ranks]
        assert all(t != "no error" and t[0] == "RanksDisagreeError" and t[2] for t in texts), texts
        assert texts[0][1] == texts[1][1]  # the same message on both ranks
        text = texts[0][1]
        assert "rank 0: " in text and "rank 1: " in text and "rows-sha256:" in text and "SAMPLE BY" in text, text
    got = ranks[0]["filtered"] + ranks[1]["filtered"]
    assert set(got) == set(range(2, ROWS, 4)) and len(got) == 16  # 15 rows over 2 ranks: one padded
    assert ranks[0]["sent_rows"] == ranks[1]["sent_rows"]  # rank 0's draw, on both
    assert Counter(ranks[0]["sent"] + ranks[1]["sent"]) == Counter(ranks[0]["sent_rows"])  # each drawn row once


@pytest.mark.parametrize(
    ("typed", "deeplake_url", "files_url"),
    [
        ("gs://bucket/seg", "gcs://bucket/seg", "gs://bucket/seg"),
        ("gcs://bucket/seg", "gcs://bucket/seg", "gs://bucket/seg"),
        ("az://container/seg", "azure://container/seg", "az://container/seg"),
        ("azure://container/seg/", "azure://container/seg/", "az://container/seg"),
        ("s3://bucket/seg", "s3://bucket/seg", "s3://bucket/seg"),
    ],
)
def test_either_spelling_of_a_cloud_names_the_same_dataset_in_both_sources(typed, deeplake_url, files_url) -> None:
    """``sources.schemes``: Deep Lake's ``gcs://``/``azure://`` and the object stores' ``gs://``/``az://``
    are accepted by both sources, each respelling the URL as its own (the docs write ``gs://``, ``az://``)."""
    from asyncload import ObjectStoreSource
    from asyncload.sources.deeplake import normalize_url

    assert normalize_url(typed) == deeplake_url
    files = ObjectStoreSource(typed)
    assert files.url == files_url and (files._bucket, files._prefix) == (files_url[5:].split("/")[0], "seg")


_POOL_CHILD = """
import json, sys, deeplake
from asyncload import DeepLakeSource
before = deeplake.storage.concurrency()
arg = {"auto": "auto", "none": None}.get(sys.argv[2], sys.argv[2])
creds = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
src = DeepLakeSource(sys.argv[1], creds=creds, storage_concurrency=arg if arg in ("auto", None) else int(arg)).open()
print(before, deeplake.storage.concurrency(), len(src))
"""


def _pool(url: str, setting: str, creds: dict[str, str] | None = None) -> tuple[int, int, int]:
    """Deep Lake's storage pool before and after a ``DeepLakeSource(url, storage_concurrency=setting)`` opens
    in a fresh interpreter (the pool is process-wide), and the dataset's rows."""
    import json
    import subprocess
    import sys

    extra = [json.dumps(creds)] if creds else []
    out = subprocess.run(
        [sys.executable, "-c", _POOL_CHILD, url, setting, *extra], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    before, after, rows = map(int, out.stdout.split())
    assert rows > 0, out.stdout
    return before, after, rows


@pytest.mark.parametrize(("setting", "pool"), [("auto", None), ("24", 24), ("none", None)])
def test_the_storage_pool_is_sized_before_the_dataset_opens(setting: str, pool: int | None, seg_url: str) -> None:
    """``storage_concurrency`` of a dataset on this machine: "auto" leaves Deep Lake's own pool (its reads
    wait on no network, and Deep Lake's memory grows with its threads: benchmarks/results/cpu/), an int
    sets it, None leaves it."""
    before, after, _ = _pool(seg_url, setting)
    assert after == (before if pool is None else pool)


def test_auto_raises_the_storage_pool_to_128_before_a_dataset_in_a_store_opens(remote_data) -> None:
    """A dataset in a store (S3 here): "auto" raises the pool to 128 before it opens, since a dataset's
    connections are fixed at its open (benchmarks/results/wan/deeplake.md)."""
    before, after, rows = _pool(remote_data.deeplake_url, "auto", remote_data.creds())
    assert after == max(before, 128) and rows == remote_data.rows
