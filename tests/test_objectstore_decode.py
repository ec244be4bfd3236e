"""The object-store source through the decode stage: JPEG and PNG files on a real S3 server (SeaweedFS)
decode with asyncload's decoders into the batch, augment like Deep Lake columns, and bad files are named."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from asyncload import AsyncLoader, ObjectStoreSource, RandomHorizontalFlip, RandomResizedCrop, ReadError
from tests.photo_data import encode, sample

from .remote_fixtures import BUCKET, RemoteData

ROWS = 24


@pytest.fixture(scope="module")
def jpeg_files(remote_data: RemoteData) -> tuple[str, list[np.ndarray], list[np.ndarray]]:
    """``jpeg/images/<i>.jpg`` (photo-like, sizes 50-120) and ``jpeg/masks/<i>.png``; file 7 is cut short."""
    images, masks = [], []
    for i in range(ROWS):
        img, mask = sample(np.random.default_rng([1, i]), 50 + 3 * i, 120 - 2 * i, aligned=True)
        data = encode(img, "jpg")
        remote_data.server.put_object(
            BUCKET, f"jpeg/images/{i:04d}.jpg", data[: len(data) * 3 // 4] if i == 7 else data
        )
        remote_data.server.put_object(BUCKET, f"jpeg/masks/{i:04d}.png", encode(mask, "png"))
        images.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
        masks.append(mask)
    return f"s3://{BUCKET}/jpeg", images, masks


def source(url: str, remote_data: RemoteData) -> ObjectStoreSource:
    return ObjectStoreSource(url, creds=remote_data.creds())


@pytest.mark.parametrize("decode", ["cpu", "store"])
def test_jpeg_files_decode_to_the_reference_pixels_and_a_bad_one_is_named(
    jpeg_files: tuple[str, list, list],
    remote_data: RemoteData,
    decode: str,
) -> None:
    url, images, masks = jpeg_files
    loader = AsyncLoader(source(url, remote_data), 1, decode=decode, on_error="skip", ragged="list")
    got = {int(b["index"][0]): (b["images"][0].numpy(), b["masks"][0].numpy()) for b in loader}
    assert sorted(got) == [i for i in range(ROWS) if i != 7]
    for i, (img, mask) in got.items():
        assert np.array_equal(img, images[i]) and np.array_equal(mask, masks[i]), i
    ((row, why),) = loader.stats()["skipped_samples"]
    assert row == 7 and "Premature end of JPEG file" in why and "'images'" in why
    with pytest.raises(
        ReadError,
        match=r"column 'images' of s3://asyncload-test/jpeg at indices \[7\] .*"
        r"s3://asyncload-test/jpeg/images/0007\.jpg.*Premature end of JPEG file",  # the file, by its key
    ):
        list(AsyncLoader(source(url, remote_data), 8, decode=decode))


def test_object_store_files_augment_with_their_masks(
    jpeg_files: tuple[str, list, list],
    remote_data: RemoteData,
) -> None:
    url, _, _ = jpeg_files
    ops = [RandomResizedCrop(32, scale=(0.3, 1.0)), RandomHorizontalFlip()]
    loader = AsyncLoader(source(url, remote_data), 8, augment=ops, on_error="skip", shuffle=True)
    n = 0
    for b in loader:
        assert b["images"].shape[1:] == (32, 32, 3) and b["masks"].shape[1:] == (32, 32)
        agree = float(((b["images"][..., 0] > 125) == (b["masks"] == 1)).float().mean())
        assert agree > 0.93
        n += len(b["index"])
    assert n == ROWS - 1
