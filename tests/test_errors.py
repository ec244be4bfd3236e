"""Errors name the thing that is wrong and keep a meaningful type."""

from __future__ import annotations

from pathlib import Path

import deeplake
import numpy as np
import pytest

from asyncload import (
    AsyncIterableDataset,
    AsyncLoader,
    ColumnNotFoundError,
    ConfigError,
    DatasetNotFoundError,
    DeepLakeSource,
)
from asyncload.errors import CollateError

pytestmark = pytest.mark.timeout(60)


def test_missing_dataset_fails_at_construction_naming_the_path(tmp_path) -> None:
    url = f"file://{tmp_path}/nothing-here"
    with pytest.raises(DatasetNotFoundError, match=f"no Deep Lake dataset at {url}") as e:
        AsyncLoader(DeepLakeSource(url))
    assert isinstance(e.value, FileNotFoundError)


def test_wrong_column_fails_at_construction_naming_column_and_dataset(seg_url) -> None:
    with pytest.raises(ColumnNotFoundError) as e:
        AsyncLoader(DeepLakeSource(seg_url, columns=("images", "labels")))
    assert str(e.value) == f"column 'labels' is not in Deep Lake dataset {seg_url} (its columns: images, masks)"
    assert isinstance(e.value, KeyError)
    with pytest.raises(ColumnNotFoundError, match="'labels'"):
        AsyncIterableDataset(DeepLakeSource(seg_url, columns=("labels",)))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"batch_size": 0}, "batch_size=0 is not allowed: an int >= 1"),
        ({"concurrency": -4}, "concurrency=-4 is not allowed: 'auto' or an int >= 1"),
        ({"prefetch": 0}, "prefetch=0 is not allowed: an int >= 1"),
        ({"read_mode": "chunk"}, "read_mode='chunk' is not allowed: 'auto', 'row' or 'column'"),
        ({"remainder": "wrap"}, "remainder='wrap' is not allowed: 'pad' or 'drop'"),
        ({"transform": 3}, "transform=3 is not allowed: None or a callable"),
        ({"loop": "trio"}, "loop='trio' is not allowed: 'auto', 'uvloop' or 'asyncio'"),
    ],
)
def test_bad_settings_name_setting_value_and_allowed(seg_url, kwargs, message) -> None:
    with pytest.raises(ConfigError) as e:
        AsyncLoader(DeepLakeSource(seg_url), **kwargs)
    assert str(e.value) == message


MISSING_CHUNK_SCRIPT = """
import json, sys
from asyncload import AsyncLoader, DeepLakeSource, ReadError
from tests.conftest import loop_threads
url = sys.argv[1]
try:
    list(AsyncLoader(DeepLakeSource(url), batch_size=8, concurrency=8, read_mode="column"))
    print(json.dumps({"raised": None}))
except ReadError as err:
    print(json.dumps({
        "raised": type(err).__name__, "is_key_error": isinstance(err, KeyError), "column": err.column,
        "source": err.source, "indices": err.indices, "message": str(err), "threads": len(loop_threads()),
    }))
"""


def test_a_missing_chunk_raises_a_typed_read_error_naming_url_column_indices(copy_of) -> None:
    """Run in a fresh process: reading a dataset with a deleted chunk occasionally segfaults inside Deep
    Lake 4.7.4 (seen about once in ten full runs), which must not take the whole suite down with it."""
    import json
    import subprocess
    import sys

    path = copy_of()
    url = f"file://{path}"
    # The images column's data chunk is the largest file; remove it, keep the masks.
    chunk = max(
        (p for p in path.rglob("*") if p.is_file() and "_deeplake_log" not in p.parts), key=lambda p: p.stat().st_size
    )
    chunk.unlink()
    root = str(Path(__file__).resolve().parents[1])
    for _ in range(3):  # a Deep Lake segfault is retried in a new process; anything else is judged
        p = subprocess.run(
            [sys.executable, "-c", MISSING_CHUNK_SCRIPT, url], capture_output=True, text=True, timeout=90, cwd=root
        )
        if p.returncode != -11:
            break
    if p.returncode == -11:
        pytest.xfail("Deep Lake 4.7.4 segfaulted reading a dataset with a missing chunk, three times")
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["is_key_error"]  # the type Deep Lake's .result() gives, not await's RuntimeError
    # the failed request's rows: the epoch's first request is its first sample alone
    assert got["column"] == "images" and got["source"] == url and got["indices"] == [0]
    assert got["message"].startswith(f"reading column 'images' of {url} at indices [0] failed: KeyError:")
    assert got["threads"] == 0  # the loop thread was stopped by the error


def test_a_failing_transform_keeps_its_type_and_names_the_batch(seg_url) -> None:
    def bad(sample):
        raise ZeroDivisionError("division by zero in user code")

    with pytest.raises(ZeroDivisionError) as e:
        next(iter(AsyncLoader(DeepLakeSource(seg_url), batch_size=4, transform=bad)))
    assert any("indices [0, 1, 2, 3]" in n and seg_url in n for n in e.value.__notes__)


def test_samples_of_different_shapes_name_column_and_index(tmp_path) -> None:
    url = f"file://{tmp_path}/ragged"
    ds = deeplake.create(url)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="png"))
    ds.append({"images": [np.zeros((8, 8, 3), np.uint8), np.zeros((8, 8, 3), np.uint8), np.zeros((9, 8, 3), np.uint8)]})
    ds.commit()
    with pytest.raises(CollateError) as e:
        list(AsyncLoader(DeepLakeSource(url, columns=("images",)), batch_size=3, read_mode="row"))
    assert "column 'images': sample at index 2 has shape (9, 8, 3), but index 0 has (8, 8, 3)" in str(e.value)


def test_a_failure_the_receiver_cannot_rebuild_arrives_as_remote_error_with_its_story() -> None:
    """The one error carrier: an exception whose pickle the receiving process cannot load (a class only the
    sender imports) still arrives, with its type name, its text and the sender's traceback."""
    from asyncload.engine.protocol import Failure, _arrived
    from asyncload.errors import RemoteError

    got = _arrived(b"not a pickle", "workers_only.ChunkError", "chunk 7 is corrupt", "Traceback: line 1\n")
    exc = got.raise_in("fan-out worker 1 of 2 (pid 9)")
    assert type(exc) is RemoteError and str(exc) == "workers_only.ChunkError: chunk 7 is corrupt"
    assert exc.__notes__ == [
        "asyncload: raised in fan-out worker 1 of 2 (pid 9); its traceback there:\nTraceback: line 1"
    ]
    local = Failure(KeyError("x"))  # within a process: the exception itself, no note
    assert local.raise_in("anywhere") is local.exc and not hasattr(local.exc, "__notes__")
