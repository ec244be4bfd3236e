"""The synthetic data: clean fixed-size rows as before, and photo-like rows of many sizes (JPEG + PNG/lz4 masks)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Literal

import deeplake
import numpy as np
import pytest

from asyncload.tools.synthetic import CLASSES, encode, make_dataset, make_photo, make_sample, photo_size

ROWS, SIZES, ASPECT = 48, (40, 120), (0.6, 1.7)


def _photos(path: Path, mask_format: Literal["lz4", "png"] = "lz4", chunk: int = 64) -> deeplake.ReadOnlyDataset:
    url = make_dataset(
        str(path), ROWS, sizes=SIZES, aspect=ASPECT, image_format="jpg", mask_format=mask_format, chunk=chunk,
        progress=False,
    )  # fmt: skip
    return deeplake.open_read_only(url)


@pytest.fixture(scope="module")
def photos_png(tmp_path_factory: pytest.TempPathFactory) -> deeplake.ReadOnlyDataset:
    return _photos(tmp_path_factory.mktemp("synthetic") / "png", mask_format="png")


def _mask(ds: deeplake.ReadOnlyDataset, i: int) -> np.ndarray:
    m = np.array(ds[i]["masks"])
    return m[..., 0] if m.ndim == 3 else m  # PNG masks read back as [H, W, 1]


@pytest.mark.timeout(20)
def test_clean_samples_are_the_ones_existing_datasets_hold() -> None:
    """``make_sample`` now draws each shape in its bounding box only; the pixels must not change, or
    datasets made before could not be regenerated (digest of the full-grid implementation)."""
    h = hashlib.sha256()
    for i in range(8):
        img, mask = make_sample(np.random.default_rng([0, i]), 48, 40)
        h.update(img.tobytes())
        h.update(mask.tobytes())
    assert h.hexdigest() == "5db7e7ab4af3ad3f1f712224995044400d75205efbab9a4e9453c023b6608fc6"


@pytest.mark.timeout(30)
def test_photo_rows_depend_only_on_seed_and_row(photos_png: deeplake.ReadOnlyDataset, tmp_path: Path) -> None:
    again = _photos(tmp_path / "again", mask_format="png", chunk=7)  # other chunking: the same rows
    for i in range(ROWS):
        assert again[i].get_bytes("images") == photos_png[i].get_bytes("images")
        assert again[i].get_bytes("masks") == photos_png[i].get_bytes("masks")
    rng = np.random.default_rng([0, 5])
    _, mask = make_photo(rng, *photo_size(rng, SIZES, ASPECT))
    assert np.array_equal(_mask(photos_png, 5), mask)
    other = make_dataset(str(tmp_path / "seed1"), 4, sizes=SIZES, seed=1, progress=False)
    assert deeplake.open_read_only(other)[0].get_bytes("images") != photos_png[0].get_bytes("images")


@pytest.mark.timeout(20)
def test_sizes_and_aspects_are_within_range_and_varied(photos_png: deeplake.ReadOnlyDataset) -> None:
    shapes = [np.array(photos_png[i]["images"]).shape for i in range(ROWS)]
    assert all(s[2] == 3 for s in shapes)
    longs = [max(s[:2]) for s in shapes]
    aspects = [s[1] / s[0] for s in shapes]
    assert all(SIZES[0] <= v <= SIZES[1] for v in longs) and len(set(longs)) > ROWS // 2
    assert all(ASPECT[0] - 0.02 <= a <= ASPECT[1] + 0.02 for a in aspects)  # sides are rounded to pixels
    assert min(aspects) < 0.9 and max(aspects) > 1.1  # portrait and landscape
    assert [_mask(photos_png, i).shape for i in range(ROWS)] == [s[:2] for s in shapes]


@pytest.mark.timeout(30)
def test_stored_bytes_are_jpeg_and_png_or_lz4_masks_of_the_same_values(
    photos_png: deeplake.ReadOnlyDataset, tmp_path: Path
) -> None:
    lz4 = _photos(tmp_path / "lz4")
    for i in range(ROWS):
        assert photos_png[i].get_bytes("images")[:3] == b"\xff\xd8\xff"
        assert photos_png[i].get_bytes("masks")[:4] == b"\x89PNG"
        assert lz4[i].get_bytes("images") == photos_png[i].get_bytes("images")
        assert np.array_equal(np.array(lz4[i]["masks"]), _mask(photos_png, i))
    png = make_dataset(str(tmp_path / "png"), 2, sizes=SIZES, image_format="png", progress=False)
    assert deeplake.open_read_only(png)[1].get_bytes("images")[:4] == b"\x89PNG"


@pytest.mark.timeout(20)
def test_masks_hold_the_class_of_the_shape_drawn_at_each_pixel(photos_png: deeplake.ReadOnlyDataset) -> None:
    """Each class has its own hue (circle red, rectangle green, triangle blue): the stored image's
    pixels under a class's mask are of that hue, so mask and image content line up."""
    seen: set[int] = set()
    for i in range(ROWS):
        image, mask = np.array(photos_png[i]["images"]).astype(np.float32), _mask(photos_png, i)
        assert set(np.unique(mask).tolist()) <= set(range(len(CLASSES)))
        for cls in range(1, len(CLASSES)):
            if (mask == cls).sum() >= 20:
                assert int(image[mask == cls].mean(0).argmax()) == cls - 1, (i, CLASSES[cls])
                seen.add(cls)
    assert seen == {1, 2, 3}


@pytest.mark.timeout(20)
def test_photos_compress_like_photos_and_clean_samples_do_not() -> None:
    """The point of the noise: 256x256 JPEG q90 photos are tens of KB, the clean scene a few."""
    photo = np.mean([len(encode(make_photo(np.random.default_rng([0, i]), 256, 256)[0], "jpg")) for i in range(6)])
    clean = np.mean([len(encode(make_sample(np.random.default_rng([0, i]), 256, 256)[0], "jpg")) for i in range(6)])
    assert 15_000 < photo < 35_000 and clean < photo / 2


@pytest.mark.timeout(20)
def test_bad_arguments_say_what_is_allowed(tmp_path: Path) -> None:
    cases = {
        "mask_format": ({"mask_format": "jpg"}, "mask_format must be 'lz4' or 'png'"),
        "sizes": ({"sizes": (90, 40)}, r"sizes must be \(lo, hi\) with 1 <= lo <= hi"),
        "aspect": ({"aspect": (0.0, 1.0)}, r"aspect must be \(lo, hi\) with 0 < lo <= hi"),
        "quality": ({"quality": 0}, "quality must be between 1 and 100"),
    }
    for name, (kw, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            make_dataset(str(tmp_path / name), 2, progress=False, **kw)  # type: ignore[arg-type]
