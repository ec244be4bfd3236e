"""The GPU decode stage (``decode="cuda"``). Its device-independent parts run on the CPU everywhere: the
geometry (``gpu.place``, the twin of ``decode.apply``), the whole stage on ``device="cpu"``, and the
fan-out's pack / unpack / finish. The nvJPEG path and the loader on a GPU run where CUDA is (marked
``gpu``; skipped without it)."""

from __future__ import annotations

import dataclasses

import deeplake
import numpy as np
import pytest
import torch

from asyncload import (
    AsyncLoader,
    DeepLakeSource,
    RandomHorizontalFlip,
    RandomResizedCrop,
    ReadError,
    Resize,
)
from asyncload.image import decode, gpu
from asyncload.image.augment import Augment
from tests.photo_data import make

CROP = [RandomResizedCrop((40, 48), scale=(0.2, 1.0)), RandomHorizontalFlip()]


def cuda_and_torchvision() -> bool:
    try:
        import torchvision.io  # noqa: F401
    except Exception:  # noqa: BLE001 - not importable beside this torch build
        return False
    return torch.cuda.is_available()


needs_gpu = pytest.mark.skipif(not cuda_and_torchvision(), reason="needs CUDA and torchvision")


@pytest.fixture(scope="module")
def photo_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make(str(tmp_path_factory.mktemp("gpu") / "jpg"), 48, image_format="jpg", mask_format="png", sizes=(60, 160))


@pytest.fixture(scope="module")
def aligned_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make(
        str(tmp_path_factory.mktemp("gpu") / "png"),
        24,
        image_format="png",
        mask_format="png",
        sizes=(60, 160),
        aligned=True,
    )


def stage_of(url: str, device: str, ops: list | None) -> tuple[decode.Stage, dict[str, list], list[int]]:
    src = DeepLakeSource(url)
    stage = decode.Stage(
        src.open().image_columns(), frozenset({"images", "masks"}), Augment(ops) if ops else None, seed=3, device=device
    )
    ds = deeplake.open_read_only(url)
    rows = list(range(len(ds)))
    values = {c: [ds[i].get_bytes(c) for i in rows] for c in ("images", "masks")}
    return stage, values, rows


def test_place_matches_the_cpu_geometry() -> None:
    rng = np.random.default_rng(0)
    img = (np.add.outer(np.arange(120), np.arange(90)) % 255).astype(np.uint8)[..., None].repeat(3, 2)
    mask = (img[..., 0] > 100).astype(np.uint8)
    aug = Augment([RandomResizedCrop(32, scale=(0.1, 1.0)), RandomHorizontalFlip()])
    for d in aug.draws(1, 0, list(range(50)), [(120, 90)] * 50):
        a, b = np.zeros((32, 32, 3), np.uint8), torch.zeros((32, 32, 3), dtype=torch.uint8)
        decode.apply(img, a, d, "image", 0)
        gpu.place(torch.from_numpy(img).permute(2, 0, 1), d, "image", b, 0)
        assert np.abs(a.astype(int) - b.numpy().astype(int)).mean() < 3.0, d
        am, bm = np.zeros((32, 32), np.uint8), torch.zeros((32, 32), dtype=torch.uint8)
        decode.apply(mask, am, d, "mask", 255)
        gpu.place(torch.from_numpy(mask)[None], d, "mask", bm, 255)
        assert (am == bm.numpy()).mean() > 0.97, d
    del rng


def test_the_device_stage_on_the_cpu_equals_the_cpu_stage_without_augmentation(photo_url: str) -> None:
    stage, values, rows = stage_of(photo_url, "cpu", None)
    cpu_stage = dataclasses.replace(stage, device=None)
    got, keep, _ = gpu.run(stage, ("images", "masks"), values, rows)
    ref, keep_ref, _ = decode.run(cpu_stage, ("images", "masks"), values, rows)
    assert keep == keep_ref == rows
    for c in ("images", "masks"):
        assert len(got[c]) == len(ref[c]) and all(
            np.array_equal(g.numpy(), r) for g, r in zip(got[c], ref[c], strict=True)
        )


def test_the_device_stage_keeps_masks_aligned_after_augmentation(aligned_url: str) -> None:
    stage, values, rows = stage_of(aligned_url, "cpu", CROP)
    got, keep, _ = gpu.run(stage, ("images", "masks"), values, rows)
    assert got["images"].shape == (24, 40, 48, 3) and got["masks"].shape == (24, 40, 48)
    bright = got["images"][..., 0] > 125
    assert float((bright == (got["masks"] == 1)).float().mean()) > 0.95


def test_pack_unpack_and_finish_make_the_batch_one_process_makes(photo_url: str) -> None:
    stage, values, rows = stage_of(photo_url, "cpu", CROP)
    packed = gpu.pack(stage, ("images", "masks"), values, rows)
    packed["index"] = torch.tensor(rows)
    cols, back, back_rows = gpu.unpack(dict(packed))
    assert cols == ["images", "masks"] and back_rows == rows
    assert back["images"] == values["images"] and back["masks"] == values["masks"]
    batch, skipped = gpu.finish(stage, packed, with_index=True)
    ref, _, _ = gpu.run(stage, ("images", "masks"), values, rows)
    assert skipped == [] and torch.equal(batch["images"], ref["images"]) and torch.equal(batch["masks"], ref["masks"])
    assert batch["index"].tolist() == rows


def test_finish_leaves_a_bad_sample_out_of_every_column_when_skipping(photo_url: str) -> None:
    stage, values, rows = stage_of(photo_url, "cpu", [Resize(32)])
    stage = dataclasses.replace(stage, on_error="skip")
    values["images"][5] = values["images"][5][:200]
    packed = gpu.pack(stage, ("images", "masks"), values, rows)
    packed["index"] = torch.tensor(rows)
    batch, skipped = gpu.finish(stage, packed, with_index=True)
    assert [r for r, _ in skipped] == [5] and "libjpeg-turbo" in skipped[0][1]
    assert batch["index"].tolist() == [r for r in rows if r != 5] and batch["images"].shape[0] == len(rows) - 1


def test_decode_cuda_with_workers_refuses_a_transform(photo_url: str) -> None:
    from asyncload import ConfigError

    with pytest.raises(ConfigError, match=r"decode='cuda' with processes=2 is not allowed with a transform"):
        AsyncLoader(DeepLakeSource(photo_url), 8, decode="cuda", processes=2, transform=lambda s: s)


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_nvjpeg_batches_arrive_on_the_device_close_to_the_cpu_decode(photo_url: str) -> None:
    cpu = {
        i: s
        for b in AsyncLoader(DeepLakeSource(photo_url), 8, decode="cpu", augment=[Resize(48)])
        for i, s in zip(b["index"].tolist(), b["images"], strict=True)
    }
    n = 0
    for b in AsyncLoader(DeepLakeSource(photo_url), 8, decode="cuda", augment=[Resize(48)], shuffle=True):
        assert (
            b["images"].device.type == "cuda" and b["masks"].device.type == "cuda" and b["index"].device.type == "cpu"
        )
        for i, img in zip(b["index"].tolist(), b["images"].cpu(), strict=True):
            assert (img.int() - cpu[i].int()).abs().float().mean() < 4.0  # nvJPEG vs libjpeg-turbo, bilinear vs area
            n += 1
    assert n == 48


@pytest.mark.gpu
@needs_gpu
@pytest.mark.timeout(180)
def test_nvjpeg_with_fanout_workers_equals_one_process(photo_url: str) -> None:
    opts = {"decode": "cuda", "augment": CROP, "shuffle": True, "seed": 4}
    one = [b for b in AsyncLoader(DeepLakeSource(photo_url), 8, **opts)]
    with AsyncLoader(DeepLakeSource(photo_url), 8, processes=2, **opts) as fan:
        two = list(fan)
    assert [b["index"].tolist() for b in one] == [b["index"].tolist() for b in two]
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a["images"], b["images"]) and torch.equal(a["masks"], b["masks"])


@pytest.mark.gpu
@needs_gpu
def test_a_truncated_jpeg_is_named_on_the_gpu_path_too(tmp_path) -> None:
    from tests.photo_data import encode, sample

    url = "file://" + str(tmp_path / "bad")
    ds = deeplake.create(url)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
    img, _ = sample(np.random.default_rng(0), 64, 64)
    j = encode(img, "jpg")
    ds.append({"images": [j, j[: len(j) * 3 // 4], j]})
    ds.commit()
    with pytest.raises(ReadError, match=r"at indices \[1\] failed: DecodeError: libjpeg-turbo: Premature end"):
        list(AsyncLoader(DeepLakeSource(url, columns=("images",)), 3, decode="cuda"))


@pytest.mark.gpu
@needs_gpu
def test_device_feed_and_resume_state_work_with_batches_already_on_the_device(photo_url: str) -> None:
    from asyncload import DeviceFeed

    loader = AsyncLoader(DeepLakeSource(photo_url), 8, decode="cuda", augment=[Resize(32)])
    feed = DeviceFeed(loader, device="cuda")
    it = iter(feed)
    first = next(it)
    assert first["images"].device.type == "cuda" and first["images"].shape == (8, 32, 32, 3)
    state = feed.state_dict()  # as of the batches the feed handed out
    rest = [i for b in it for i in b["index"].tolist()]
    feed.close()
    again = AsyncLoader(DeepLakeSource(photo_url), 8, decode="cuda", augment=[Resize(32)])
    again.load_state_dict(state)
    assert [i for b in again for i in b["index"].tolist()] == rest
    assert sorted(first["index"].tolist() + rest) == list(range(48))
