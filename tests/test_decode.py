"""The decode stage on real Deep Lake datasets of photo-like JPEG and PNG: pixels equal to Deep Lake's own
decode, one mask shape, bad bytes named (and skipped when asked), the byte budget's default, and the settings."""

from __future__ import annotations

import logging
from pathlib import Path

import deeplake
import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, ConfigError, DeepLakeSource, RandomResizedCrop, ReadError
from asyncload.image import codecs
from asyncload.sources.subset import RangeSource
from tests.photo_data import encode, make, sample

from .conftest import WORKER_START

ROWS = 70


@pytest.fixture(scope="module")
def jpeg_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make(str(tmp_path_factory.mktemp("dec") / "jpg"), ROWS, image_format="jpg", mask_format="lz4")


@pytest.fixture(scope="module")
def png_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make(str(tmp_path_factory.mktemp("dec") / "png"), ROWS, image_format="png", mask_format="png")


def reference(url: str) -> dict[str, list[np.ndarray]]:
    ds = deeplake.open_read_only(url)
    return {c: [np.asarray(ds[i][c]) for i in range(len(ds))] for c in ("images", "masks")}


def epoch(url: str, **opts: object) -> dict[int, dict[str, np.ndarray]]:
    out: dict[int, dict[str, np.ndarray]] = {}
    for b in AsyncLoader(DeepLakeSource(url), 16, shuffle=True, **opts):
        for j, i in enumerate(b["index"].tolist()):
            assert i not in out, f"row {i} came twice"
            out[i] = {c: b[c][j].numpy() for c in ("images", "masks")}
    return out


@pytest.mark.parametrize("fmt", ["jpeg", "png"])
@pytest.mark.parametrize("read_mode", ["row", "column"])
def test_pixels_equal_deep_lakes_decode(fmt: str, read_mode: str, jpeg_url: str, png_url: str) -> None:
    url = jpeg_url if fmt == "jpeg" else png_url
    ref = reference(url)
    got = epoch(url, decode="cpu", read_mode=read_mode)
    assert sorted(got) == list(range(ROWS))
    for i, s in got.items():
        assert np.array_equal(s["images"], ref["images"][i]), f"row {i}"
        assert s["masks"].shape == (64, 64) and np.array_equal(s["masks"], ref["masks"][i].reshape(64, 64))


@pytest.mark.parametrize("decode", ["cpu", "store"])
def test_a_mask_comes_back_h_by_w_whatever_its_compression(decode: str, jpeg_url: str, png_url: str) -> None:
    for url in (jpeg_url, png_url):
        b = next(iter(AsyncLoader(DeepLakeSource(url), 8, decode=decode)))
        assert b["masks"].shape == (8, 64, 64) and b["masks"].dtype == torch.uint8
        assert b["images"].shape == (8, 64, 64, 3)


def test_the_cpu_decode_reads_stored_bytes_and_the_store_decode_does_not(jpeg_url: str) -> None:
    """What each setting reads: the stored JPEG bytes (a fraction of the pixels) or decoded arrays."""
    cpu, store = (
        AsyncLoader(DeepLakeSource(jpeg_url), 16, decode="cpu"),
        AsyncLoader(DeepLakeSource(jpeg_url), 16, decode="store"),
    )
    list(cpu), list(store)
    masks = ROWS * 64 * 64
    assert store.stats()["samples_read"] == cpu.stats()["samples_read"] == ROWS
    assert store.stats()["bytes_per_s"] > 0
    read_cpu = cpu.stats()["bytes_per_s"] * cpu.stats()["elapsed_s"]
    read_store = store.stats()["bytes_per_s"] * store.stats()["elapsed_s"]
    assert read_store == pytest.approx(ROWS * 64 * 64 * 3 + masks)
    assert read_cpu < masks + ROWS * 64 * 64 * 3 / 2  # stored JPEG bytes: well under the pixels
    assert cpu.stats()["cpu_decode_s"] > 0


# -- bad bytes -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """12 rows of JPEG images and PNG masks; row 3's JPEG is cut short, row 6's PNG mask has a damaged
    IDAT, row 9's image is zero bytes."""
    url = "file://" + str(tmp_path_factory.mktemp("bad") / "ds")
    ds = deeplake.create(url)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="png"))
    images, masks = [], []
    for i in range(12):
        img, mask = sample(np.random.default_rng(i), 48, 48)
        j, p = encode(img, "jpg"), bytearray(encode(mask, "png"))
        if i == 3:
            j = j[: len(j) * 3 // 4]  # the header intact
        if i == 6:
            p[60] ^= 0xFF
        images.append(b"" if i == 9 else j)
        masks.append(bytes(p))
    ds.append({"images": images, "masks": masks})
    ds.commit()
    return url


@pytest.mark.parametrize(
    ("row", "column", "message"),
    [
        (3, "images", "libjpeg-turbo: Premature end of JPEG file"),
        (6, "masks", "libspng: IDAT stream error"),
        (9, "images", "empty sample (0 bytes)"),
    ],
)
def test_bad_bytes_raise_a_read_error_naming_url_column_row_and_decoder(
    bad_url: str, row: int, column: str, message: str
) -> None:
    one = RangeSource(DeepLakeSource(bad_url), row, row + 1)
    with pytest.raises(ReadError) as info:
        list(AsyncLoader(one, 1, decode="cpu"))
    err = info.value
    assert str(err).startswith(
        f"reading column '{column}' of {bad_url} at indices [{row}] failed: DecodeError: {message}"
    )
    assert (err.column, err.indices) == (column, [row]) and isinstance(err.__cause__, codecs.DecodeError)


def test_a_bad_sample_in_a_whole_epoch_raises_and_loses_nothing_before_it(bad_url: str) -> None:
    got: list[int] = []
    with pytest.raises(ReadError, match=r"at indices \[3\] failed: DecodeError: libjpeg-turbo"):
        for b in AsyncLoader(DeepLakeSource(bad_url), 3, decode="cpu"):
            got += b["index"].tolist()
    assert got == [0, 1, 2]


def test_bad_bytes_are_skipped_counted_and_reported_when_asked(bad_url: str, caplog: pytest.LogCaptureFixture) -> None:
    loader = AsyncLoader(DeepLakeSource(bad_url), 5, on_error="skip", shuffle=True, decode="cpu")
    with caplog.at_level(logging.WARNING, logger="asyncload"):
        got = sorted(i for b in loader for i in b["index"].tolist())
    assert got == [i for i in range(12) if i not in (3, 6, 9)]
    st = loader.stats()
    assert st["skipped"] == 3
    assert sorted(i for i, _ in st["skipped_samples"]) == [3, 6, 9]
    why = dict(st["skipped_samples"])
    assert "Premature end of JPEG file" in why[3] and "'masks'" in why[6] and "0 bytes" in why[9]
    assert "skipped 3 samples" in caplog.text


def test_an_empty_array_from_the_store_is_named_not_collated(bad_url: str) -> None:
    """decode="store": Deep Lake returns shape () for bytes it cannot decode; that is a read error of that
    row, not a CollateError about ragged shapes."""
    with pytest.raises(
        ReadError, match=rf"column 'images' of {bad_url} at indices \[9\] failed: DecodeError: .*shape \(\)"
    ):
        list(AsyncLoader(RangeSource(DeepLakeSource(bad_url), 9, 10), 1, decode="store"))


# -- the byte budget (what it bounds: test_pipeline) ------------------------------------------------


def test_the_budget_defaults_to_1_gib_or_an_eighth_of_memory() -> None:
    from asyncload import LoaderOptions

    total = __import__("os").sysconf("SC_PAGE_SIZE") * __import__("os").sysconf("SC_PHYS_PAGES")
    assert LoaderOptions().budget_bytes == min(1 << 30, total // 8)


# -- settings ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"decode": "gpu"}, r"decode='gpu' is not allowed: 'auto', 'cpu', 'store', 'cuda' or 'cuda:N'"),
        ({"memory_budget": 0}, r"memory_budget=0 is not allowed: 'auto' or a number of bytes >= 1"),
        (
            {"augment": ["flip"]},
            r"augment='flip' is not allowed: a list of Resize, RandomResizedCrop and RandomHorizontalFlip",
        ),
        (
            {"augment": [RandomResizedCrop(32), RandomResizedCrop(32)]},
            r"augment=.* is not allowed: at most one Resize or RandomResizedCrop",
        ),
    ],
)
def test_bad_settings_name_themselves(jpeg_url: str, settings: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AsyncLoader(DeepLakeSource(jpeg_url), 4, **settings)


def test_augment_needs_an_image_column(tmp_path: Path) -> None:
    url = "file://" + str(tmp_path / "labels")
    ds = deeplake.create(url)
    ds.add_column("label", deeplake.types.Int32())
    ds.append({"label": [1, 2]})
    ds.commit()
    with pytest.raises(
        ConfigError, match=r"augment=.* is not allowed for .*labels: none of the columns label is an image or a mask"
    ):
        AsyncLoader(DeepLakeSource(url, columns=("label",)), 2, augment=[RandomResizedCrop(8)])


@pytest.mark.timeout(180)
def test_fanout_and_dataloader_workers_decode_the_same_pixels(png_url: str) -> None:
    from torch.utils.data import DataLoader

    from asyncload import AsyncIterableDataset

    ref = reference(png_url)

    def check(batches: object) -> None:
        seen = []
        for b in batches:  # type: ignore[attr-defined]
            for j, i in enumerate(b["index"].tolist()):
                assert np.array_equal(b["images"][j].numpy(), ref["images"][i]), i
                assert np.array_equal(b["masks"][j].numpy(), ref["masks"][i].reshape(64, 64)), i
                seen.append(i)
        assert sorted(seen) == list(range(ROWS))

    with AsyncLoader(DeepLakeSource(png_url), 16, shuffle=True, decode="cpu", processes=2) as fan:
        check(fan)
    ds = AsyncIterableDataset(DeepLakeSource(png_url), batch_size=16, shuffle=True, decode="cpu")
    check(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START))


@pytest.mark.timeout(180)
def test_a_bad_sample_in_a_worker_reaches_the_training_process_named(bad_url: str) -> None:
    from torch.utils.data import DataLoader

    from asyncload import AsyncIterableDataset

    with AsyncLoader(DeepLakeSource(bad_url), 3, processes=2, decode="cpu") as fan:
        with pytest.raises(
            ReadError, match=r"column 'images' of .* at indices \[3\] failed: DecodeError: libjpeg-turbo"
        ):
            list(fan)
    ds = AsyncIterableDataset(DeepLakeSource(bad_url), batch_size=3, on_error="skip", decode="cpu")
    got = sorted(
        i
        for b in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)
        for i in b["index"].tolist()
    )
    assert got == [i for i in range(12) if i not in (3, 6, 9)]


def test_auto_decodes_deep_lake_jpeg_png_and_lz4_columns_itself_with_column_reads(jpeg_url: str) -> None:
    """decode="auto" reads the stored bytes of every image and mask column (JPEG images, lz4 masks) and
    read_mode="auto" reads them by column; decode="store" reads Deep Lake's arrays, per row."""
    auto, cpu = AsyncLoader(DeepLakeSource(jpeg_url), 16), AsyncLoader(DeepLakeSource(jpeg_url), 16, decode="cpu")
    store = AsyncLoader(DeepLakeSource(jpeg_url), 16, decode="store", read_mode="row")
    list(auto), list(cpu), list(store)
    # column reads (the first batch's first sample alone, then the rest); per row
    assert auto.stats()["requests"] == -(-ROWS // 16) + 1 and store.stats()["requests"] == ROWS

    def read(loader: AsyncLoader) -> float:
        return loader.stats()["bytes_per_s"] * loader.stats()["elapsed_s"]

    assert read(auto) == pytest.approx(read(cpu)) and read(auto) < read(store) / 2  # stored bytes: JPEG, lz4
    assert DeepLakeSource(jpeg_url).open().preferred_read_mode == "column"


_NO_OPENCV_CHILD = """
import sys
from asyncload import AsyncLoader, DeepLakeSource, RandomResizedCrop
for url in sys.argv[1:]:
    rows = sum(len(b["index"]) for b in AsyncLoader(DeepLakeSource(url), 16, shuffle=True, processes=0))
    print(url.rsplit("/", 1)[-1], rows, "cv2" in sys.modules)
next(iter(AsyncLoader(DeepLakeSource(sys.argv[1]), 4, processes=0, augment=RandomResizedCrop(32))))
print("augment", "cv2" in sys.modules)
"""


@pytest.mark.timeout(120)
def test_an_epoch_without_augmentation_never_imports_opencv(jpeg_url: str, png_url: str) -> None:
    """OpenCV's import costs ~0.1-0.2 s of CPU (its OpenBLAS threads spin): a JPEG or PNG epoch decoded by
    libjpeg-turbo, libspng and lz4 does without it, and a crop brings it in (a fresh interpreter each)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _NO_OPENCV_CHILD, jpeg_url, png_url], capture_output=True, text=True, timeout=100
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == [f"jpg {ROWS} False", f"png {ROWS} False", "augment True"], out.stdout


def test_without_opencv_auto_lets_the_store_decode(jpeg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """decode="auto" where OpenCV is not installed: the store decodes (its arrays are read, not stored bytes),
    every row once, the same pixels, and the log says what is missing once."""
    import importlib.util

    from asyncload.image import decode as decode_module

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cv2" else real(name, *a))
    assert decode_module.decoders_available() == "cv2"
    logged: list[str] = []
    monkeypatch.setattr(decode_module, "log_once", lambda msg, *a: logged.append(msg))
    ref = reference(jpeg_url)
    loader = AsyncLoader(DeepLakeSource(jpeg_url), 16, processes=0)
    got = {i: b["images"][j].numpy() for b in loader for j, i in enumerate(b["index"].tolist())}
    assert sorted(got) == list(range(ROWS))
    assert all(np.array_equal(got[i], ref["images"][i]) for i in got)
    assert loader.stats()["bytes_per_s"] * loader.stats()["elapsed_s"] == pytest.approx(ROWS * (64 * 64 * 3 + 64 * 64))
    assert logged == ["asyncload: cv2 not importable; the store decodes images (decode='store')"]
