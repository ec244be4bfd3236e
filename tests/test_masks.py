"""Masks through the default path, on real Deep Lake datasets of photo-like JPEG and PNG images with lz4
and PNG masks: asyncload reads their stored bytes (lz4 masks sized by their paired image) and the pixels
equal Deep Lake's own decode, with and without augmentation, in one process, in fan-out workers and in
DataLoader workers. Where a mask cannot be paired (no image column; a size that is not its image's), Deep
Lake decodes it, the log says so once, and the pixels are still Deep Lake's.

Every dataset here is valid: no Deep Lake read fails inside the test process."""

from __future__ import annotations

import logging

import deeplake
import numpy as np
import pytest
from torch.utils.data import DataLoader

from asyncload import (
    AsyncIterableDataset,
    AsyncLoader,
    DeepLakeSource,
    LoaderOptions,
    RandomHorizontalFlip,
    RandomResizedCrop,
)
from asyncload.image import codecs
from asyncload.image.decode import decode_stage
from asyncload.runtime import log as _log
from tests.photo_data import make, make_odd_masks

from .conftest import WORKER_START

ROWS = 40
AUG = [RandomResizedCrop((40, 48), scale=(0.2, 1.0)), RandomHorizontalFlip()]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", params=["jpg-lz4", "png-lz4", "jpg-png", "png-png"])
def url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Photo-like images of 48–96 px a side (every row its own size) and their masks."""
    image, mask = request.param.split("-")
    return make(str(tmp_path_factory.mktemp("masks") / request.param), ROWS, image_format=image,
                mask_format=mask, sizes=(48, 96))  # fmt: skip


def reference(url: str, cols: tuple[str, ...] = ("images", "masks")) -> dict[str, list[np.ndarray]]:
    """Deep Lake's own decode of every row (masks as H×W)."""
    ds = deeplake.open_read_only(url)
    out = {c: [np.asarray(ds[i][c]) for i in range(len(ds))] for c in cols}
    if "masks" in out:
        out["masks"] = [m.reshape(m.shape[:2]) for m in out["masks"]]
    return out


def collect(batches: object, cols: tuple[str, ...] = ("images", "masks")) -> dict[int, dict[str, np.ndarray]]:
    out: dict[int, dict[str, np.ndarray]] = {}
    for b in batches:  # type: ignore[attr-defined]
        for j, i in enumerate(b["index"].tolist()):
            assert i not in out, f"row {i} came twice"
            out[i] = {c: np.asarray(b[c][j]) for c in cols}
    assert sorted(out) == list(range(ROWS))
    return out


def assert_equal(got: dict[int, dict[str, np.ndarray]], want: dict[str, list[np.ndarray]]) -> None:
    """Every row of ``got`` equals ``want`` (column → rows), shapes and pixels."""
    for i, s in got.items():
        for c, a in s.items():
            w = want[c][i]
            assert a.shape == w.shape and np.array_equal(a, w), f"row {i}, column {c!r}"


def test_the_default_path_reads_stored_bytes_and_decodes_deep_lakes_pixels(url: str) -> None:
    loader = AsyncLoader(DeepLakeSource(url), 8, shuffle=True, ragged="list")
    got = collect(loader)
    assert_equal(got, reference(url))
    assert loader.read_mode == "column"
    stage = decode_stage(DeepLakeSource(url).open(), LoaderOptions())
    assert stage is not None and stage.encoded == {"images", "masks"} and stage.pair == "images"


def test_augmented_masks_equal_the_store_decoded_path(url: str) -> None:
    """The same draws applied to Deep Lake's arrays (decode="store") and to the stored bytes decoded here:
    masks (nearest) equal; lossless images equal; JPEG images equal where no scaled decode was used."""
    mine = collect(AsyncLoader(DeepLakeSource(url), 8, shuffle=True, augment=AUG, seed=3))
    store = collect(AsyncLoader(DeepLakeSource(url), 8, shuffle=True, augment=AUG, seed=3, decode="store"))
    lossless = url.rsplit("/", 1)[-1].startswith("png-")
    for i in range(ROWS):
        assert np.array_equal(mine[i]["masks"], store[i]["masks"]), f"row {i}"
        if lossless:
            assert np.array_equal(mine[i]["images"], store[i]["images"]), f"row {i}"


@pytest.mark.timeout(240)
def test_fanout_and_dataloader_workers_decode_deep_lakes_pixels(url: str) -> None:
    ref = reference(url)
    with AsyncLoader(DeepLakeSource(url), 8, shuffle=True, ragged="list", processes=2) as fan:
        assert_equal(collect(fan), ref)
    ds = AsyncIterableDataset(DeepLakeSource(url), batch_size=8, shuffle=True, ragged="list")
    assert_equal(collect(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)), ref)


# -- where a mask cannot be paired ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Rows 5 and 17 of whose masks are 32×48 (not their image's size)."""
    return make_odd_masks("file://" + str(tmp_path_factory.mktemp("odd") / "ds"), ROWS, (5, 17), seed=9)


def test_a_mask_whose_size_is_not_its_images_is_decoded_by_deep_lake_and_said_once(
    odd_url: str, caplog: pytest.LogCaptureFixture
) -> None:

    _log._said.clear()  # noqa: SLF001 - the log is once per process
    assert_equal(collect(AsyncLoader(DeepLakeSource(odd_url), 8, shuffle=True, ragged="list")), reference(odd_url))
    # The warning is said where the masks are read: in this process with processes=0 (else the reader's stderr)
    with caplog.at_level(logging.WARNING, logger="asyncload"):
        got = collect(AsyncLoader(DeepLakeSource(odd_url), 8, shuffle=True, ragged="list", processes=0))
        collect(AsyncLoader(DeepLakeSource(odd_url), 8, ragged="list", processes=0))
    assert_equal(got, reference(odd_url))
    assert got[5]["masks"].shape == (32, 48) and got[6]["masks"].shape == (64, 64)
    said = [r.getMessage() for r in caplog.records if "lz4 mask column 'masks'" in r.getMessage()]
    assert said == [
        f"asyncload: {odd_url}: lz4 mask column 'masks' has masks whose size is not their image's "
        f"(1536 bytes against 'images''s 64x64); the store decodes those masks"
    ]


def test_a_mask_without_an_image_column_is_decoded_by_deep_lake_and_said_once(
    odd_url: str, caplog: pytest.LogCaptureFixture
) -> None:

    _log._said.clear()  # noqa: SLF001
    with caplog.at_level(logging.WARNING, logger="asyncload"):
        got = collect(AsyncLoader(DeepLakeSource(odd_url, columns=("masks",)), 8, ragged="list"), ("masks",))
        collect(AsyncLoader(DeepLakeSource(odd_url, columns=("masks",)), 8, ragged="list"), ("masks",))
    assert_equal(got, reference(odd_url, ("masks",)))
    said = [r.getMessage() for r in caplog.records if "lz4 mask" in r.getMessage()]
    assert said == [
        f"asyncload: {odd_url}: the store decodes lz4 mask column(s) 'masks': an lz4 blob holds no shape, "
        "and no image column read here gives one"
    ]


# -- the lz4 codec, bytes only ---------------------------------------------------------------------------


def test_lz4_bytes_decode_into_the_row_and_bad_ones_raise_with_lz4s_message(odd_url: str) -> None:
    ds = deeplake.open_read_only(odd_url)
    blob = ds["masks"].get_bytes([0])[0]
    want = np.asarray(ds[0]["masks"]).reshape(64, 64)
    row = np.zeros((64, 64), np.uint8)
    got = codecs.decode(blob, "gray", row, head=codecs.lz4_header(blob, 64, 64))
    assert np.shares_memory(got, row) and np.array_equal(row, want)
    alone = codecs.decode(blob, "gray", head=codecs.Header("lz4", 64, 64))  # no row: an array of its own
    assert alone.flags.writeable and np.array_equal(alone, want)
    with pytest.raises(codecs.DecodeError, match=r"^lz4 mask of 4096 bytes, but its image is 64x32 \(2048 pixels\)$"):
        codecs.lz4_header(blob, 64, 32)
    with pytest.raises(codecs.DecodeError, match=r"^lz4 blob cut short \(3 bytes\)$"):
        codecs.lz4_header(blob[:3], 64, 64)
    with pytest.raises(codecs.DecodeError, match=r"^lz4: "):
        codecs.decode(blob[: len(blob) // 2], "gray", head=codecs.Header("lz4", 64, 64))
