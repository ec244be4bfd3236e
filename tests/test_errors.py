"""Errors name the thing that is wrong and keep a meaningful type."""

from __future__ import annotations

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
    ReadError,
)
from asyncload.collate import CollateError

from .conftest import wait_no_loop_threads

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


def test_a_missing_chunk_raises_a_typed_read_error_naming_url_column_indices(copy_of) -> None:
    path = copy_of()
    url = f"file://{path}"
    ds = deeplake.open_read_only(url)
    del ds
    # The images column's data chunk is the largest file; remove it, keep the masks.
    chunk = max((p for p in path.rglob("*") if p.is_file() and "_deeplake_log" not in p.parts), key=lambda p: p.stat().st_size)
    chunk.unlink()
    loader = AsyncLoader(DeepLakeSource(url), batch_size=8, concurrency=8, read_mode="column")
    with pytest.raises(ReadError) as e:
        list(loader)
    err = e.value
    assert isinstance(err, KeyError)  # the type Deep Lake's .result() gives, not await's RuntimeError
    assert err.column == "images" and err.source == url and err.indices == list(range(8))
    assert str(err).startswith(f"reading column 'images' of {url} at indices [0, 1, 2, 3, 4, 5, 6, 7] failed: KeyError:")
    wait_no_loop_threads()
    # Not tested here: concurrent per-row reads of a missing chunk can segfault inside Deep Lake 4.7.4
    # (seen in this test); process isolation for such crashes belongs to the multiprocess fan-out.


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
