"""lz4 masks without Deep Lake's decode (``lz4masks``, the GPU stage's mask path): the blob parsing, the
python-lz4 path into one staging buffer, and the device stage run on the CPU, each equal to Deep Lake's
own decode of the same rows. nvCOMP's path needs a GPU (marked ``gpu``)."""

from __future__ import annotations

import deeplake
import numpy as np
import pytest
import torch

from asyncload import DeepLakeSource, LoaderOptions, RandomHorizontalFlip, RandomResizedCrop
from asyncload.image import decode, gpu
from asyncload.image.augment import Augment
from asyncload.image.codecs import DecodeError, lz4_header, lz4_size
from asyncload.image.lz4masks import choose, decode_batch, decompress_into, host_buffer
from tests.photo_data import make


@pytest.fixture(scope="module")
def lz4_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make(str(tmp_path_factory.mktemp("lz4") / "d"), 24, image_format="jpg", mask_format="lz4", sizes=(40, 90))


def rows_of(url: str) -> tuple[list[bytes], list[np.ndarray], list[tuple[int, int]]]:
    ds = deeplake.open_read_only(url)
    n = len(ds)
    blobs = [ds[i].get_bytes("masks") for i in range(n)]
    masks = [np.asarray(ds[i]["masks"]) for i in range(n)]
    return blobs, masks, [m.shape[:2] for m in masks]


def test_a_blob_is_a_little_endian_size_and_one_raw_block(lz4_url: str) -> None:
    blobs, masks, shapes = rows_of(lz4_url)
    for b, (h, w) in zip(blobs, shapes, strict=True):
        assert lz4_size(b) == lz4_size(memoryview(b)) == h * w  # (a reader's answer arrives as a view)
    assert lz4_size(b"\x10\x00\x00\x00") == -1  # a size and no block
    with pytest.raises(DecodeError, match=r"^lz4 blob cut short \(4 bytes\)$"):
        lz4_header(b"\x10\x00\x00\x00", 4, 4)


def test_python_lz4_into_one_buffer_equals_deep_lakes_decode(lz4_url: str) -> None:
    blobs, masks, shapes = rows_of(lz4_url)
    buf = host_buffer(sum(h * w for h, w in shapes), pinned=False)
    failed: list[int] = []
    offsets = decompress_into(blobs, buf.numpy(), lambda k, e: failed.append(k))
    assert failed == []
    for a, m in zip(offsets, masks, strict=True):
        assert np.array_equal(buf.numpy()[a : a + m.size].reshape(m.shape), m)


def test_decode_batch_names_a_size_that_is_not_its_images_and_a_cut_block(lz4_url: str) -> None:
    blobs, masks, shapes = rows_of(lz4_url)
    blobs = list(blobs)
    blobs[3] = blobs[3][: len(blobs[3]) // 2]
    shapes = list(shapes)
    shapes[5] = (shapes[5][0] + 1, shapes[5][1])
    shapes[7] = None  # its image failed: the mask is left out, not reported twice
    errors: dict[int, str] = {}
    got = decode_batch(blobs, shapes, torch.device("cpu"), lambda k, e: errors.setdefault(k, str(e)), way="cpu")
    assert sorted(errors) == [3, 5] and "lz4" in errors[3] and f"its image is {shapes[5][0]}x" in errors[5]
    for k, (t, m) in enumerate(zip(got, masks, strict=True)):
        if k in (3, 5, 7):
            assert t is None
        else:
            assert t is not None and t.shape == (1, *m.shape) and np.array_equal(t[0].numpy(), m)


def test_choose_takes_python_lz4_off_cuda() -> None:
    assert choose(256, torch.device("cpu")) == "cpu"


def test_lz4_masks_are_read_as_stored_bytes_beside_an_image_column_only(lz4_url: str) -> None:
    src = DeepLakeSource(lz4_url).open()
    assert src.image_columns()["masks"].stored == "lz4"
    cuda = decode.decode_stage(src, LoaderOptions(decode="cuda"))
    cpu = decode.decode_stage(src, LoaderOptions(decode="cpu"))
    alone = decode.decode_stage(DeepLakeSource(lz4_url, columns=["masks"]).open(), LoaderOptions(decode="cuda"))
    assert cuda is not None and cuda.encoded == {"images", "masks"}
    assert cpu is not None and cpu.encoded == {"images", "masks"}  # the CPU stage decodes them too (codecs)
    assert alone is not None and alone.encoded == frozenset()


@pytest.mark.parametrize("ops", [None, [RandomResizedCrop((32, 40), scale=(0.3, 1.0)), RandomHorizontalFlip()]])
def test_the_device_stage_on_the_cpu_pairs_lz4_masks_as_deep_lakes_decode_does(lz4_url: str, ops: list | None) -> None:
    src = DeepLakeSource(lz4_url).open()
    blobs, masks, _ = rows_of(lz4_url)
    ds = deeplake.open_read_only(lz4_url)
    rows = list(range(len(blobs)))
    images = [ds[i].get_bytes("images") for i in rows]
    aug = Augment(ops) if ops else None
    stage = decode.DecodeStage(src.image_columns(), frozenset({"images", "masks"}), aug, seed=3, device="cpu")
    store = decode.DecodeStage(src.image_columns(), frozenset({"images"}), aug, seed=3, device="cpu")
    got, keep, _ = gpu.run(stage, ("images", "masks"), {"images": images, "masks": blobs}, rows)
    ref, keep_ref, _ = gpu.run(store, ("images", "masks"), {"images": images, "masks": masks}, rows)
    assert keep == keep_ref == rows
    for a, b in zip(got["masks"], ref["masks"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(120)
def test_nvcomp_and_python_lz4_give_deep_lakes_masks_on_the_device(lz4_url: str) -> None:
    pytest.importorskip("nvidia.nvcomp")
    blobs, masks, shapes = rows_of(lz4_url)
    for way in ("nvcomp", "cpu"):
        errors: list[int] = []
        got = decode_batch(blobs, shapes, torch.device("cuda"), lambda k, e, errors=errors: errors.append(k), way=way)
        assert errors == []
        for t, m in zip(got, masks, strict=True):
            assert t is not None and t.is_cuda and np.array_equal(t[0].cpu().numpy(), m)


def test_the_budgets_first_guess_counts_lz4_masks_at_their_decoded_size(lz4_url: str) -> None:
    """The byte budget's decoded-per-read ratio, guessed from the first read, counts each lz4 mask at the
    H×W its blob declares (it has no image header to read), so the guess equals the true ratio."""
    import asyncio

    src = DeepLakeSource(lz4_url).open()
    stage = decode.decode_stage(src, LoaderOptions())
    assert stage is not None and stage.encoded == {"images", "masks"}

    async def first_read() -> dict:
        return await src.read(list(range(8)), stage.encoded)

    part = asyncio.run(first_read())
    blobs, masks, sizes = rows_of(lz4_url)
    read = sum(len(v) for c in ("images", "masks") for v in part[c])
    decoded = sum(4 * h * w for h, w in sizes[:8])  # an RGB image and its one-byte mask per pixel
    assert stage.decoded_ratio(part) == pytest.approx(decoded / read)
