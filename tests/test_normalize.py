"""Model-ready batches (``normalize``, ``layout``, ``dtype``): every output equals torchvision's arithmetic
done by hand in torch on the uint8 batch the same loader gives without them (``ToDtype(float32,
scale=True)`` is ``x.float().mul_(1 / 255)``, then ``Normalize`` subtracts and divides, then one cast), in
one process, through fan-out workers, DataLoader workers, the device stage's ``finish`` and ``DeviceFeed``
on the CPU. Masks stay the uint8 class ids. Bad settings are refused naming the setting."""

from __future__ import annotations

import dataclasses
import pickle

import deeplake
import pytest
import torch
from torch.utils.data import DataLoader

from asyncload import (
    AsyncIterableDataset,
    AsyncLoader,
    ConfigError,
    DeepLakeSource,
    DeviceFeed,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)
from asyncload.image import decode, gpu
from asyncload.image.augment import Augment
from asyncload.image.normalize import ModelReady
from tests.photo_data import make

from .conftest import WORKER_START

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CROP = [RandomResizedCrop((40, 48), scale=(0.2, 1.0)), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def photo_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make(str(tmp_path_factory.mktemp("norm") / "jpg"), 32, image_format="jpg", mask_format="lz4", sizes=(50, 90))


def by_hand(x: torch.Tensor, layout: str = "NHWC", dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
    """torchvision's ``ToDtype(torch.float32, scale=True)`` then ``Normalize(MEAN, STD)``, on uint8 NHWC."""
    y = x.float().mul_(1.0 / 255).sub(torch.tensor(MEAN)).div_(torch.tensor(STD))
    if layout == "NCHW":
        y = y.permute(*range(y.ndim - 3), -1, -3, -2).contiguous()
    return y.to(dtype or torch.float32)


def by_row(batches: list[dict]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return {
        int(i): (im, m) for b in batches for i, im, m in zip(b["index"].tolist(), b["images"], b["masks"], strict=True)
    }


def reference(url: str, **opts) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    return by_row(list(AsyncLoader(DeepLakeSource(url), 8, decode="cpu", seed=5, **opts)))


# -- the arithmetic -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["NHWC", "NCHW"])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float16, torch.bfloat16])
def test_every_value_of_every_channel_equals_torchvisions_arithmetic(layout: str, dtype: torch.dtype | None) -> None:
    x = torch.arange(256, dtype=torch.uint8)[None, :, None, None].expand(2, 256, 5, 3).contiguous()
    x[1] = x[1].flip(0)
    ready = ModelReady.of((MEAN, STD), layout, dtype)
    assert ready is not None
    want = by_hand(x, layout, dtype)
    for got in (
        ready.apply(x, "images"),
        ready.on_device(x, "images"),
        pickle.loads(pickle.dumps(ready)).apply(x, "i"),
    ):
        assert got.dtype == (dtype or torch.float32) and got.is_contiguous()
        assert torch.equal(got, want)  # bit for bit: the table holds that very float32 arithmetic


def test_the_same_within_float32_rounding_of_x_over_255() -> None:
    """``x / 255`` and torchvision's ``x * (1 / 255)`` differ in the last bit for about half the values; after
    dividing by std (>= 0.224) that is under 4 float32 ulps of 2.6 (the largest output), so 2e-6 bounds it."""
    x = torch.arange(256, dtype=torch.uint8)[None, :, None, None].expand(1, 256, 1, 3).contiguous()
    got = ModelReady.of((MEAN, STD), "NHWC", torch.float32).apply(x, "images")  # type: ignore[union-attr]
    plain = (x.float() / 255 - torch.tensor(MEAN)) / torch.tensor(STD)
    assert float((got - plain).abs().max()) <= 2e-6


def test_dtype_alone_scales_to_0_1_and_layout_alone_permutes_uint8() -> None:
    x = torch.randint(0, 256, (3, 7, 9, 3), dtype=torch.uint8)
    scaled = ModelReady.of(None, "NHWC", torch.bfloat16).apply(x, "images")  # type: ignore[union-attr]
    assert torch.equal(scaled, x.float().mul_(1.0 / 255).to(torch.bfloat16))
    nchw = ModelReady.of(None, "NCHW", None).apply(x, "images")  # type: ignore[union-attr]
    assert nchw.dtype == torch.uint8 and torch.equal(nchw, x.permute(0, 3, 1, 2))
    assert ModelReady.of(None, "NHWC", None) is None


# -- through the loader --------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("augment", [None, CROP], ids=["plain", "augmented"])
@pytest.mark.parametrize(
    ("layout", "dtype"), [("NHWC", None), ("NCHW", torch.float32), ("NCHW", torch.bfloat16), ("NHWC", torch.float16)]
)
def test_the_loader_delivers_the_uint8_batch_made_model_ready(
    photo_url: str, augment: list | None, layout: str, dtype: torch.dtype | None
) -> None:
    aug = {"augment": augment} if augment else {"augment": [Resize(48)]}
    ref = reference(photo_url, **aug)
    got = reference(photo_url, normalize=(MEAN, STD), layout=layout, dtype=dtype, **aug)
    assert got.keys() == ref.keys()
    for i, (im, m) in got.items():
        assert torch.equal(im, by_hand(ref[i][0], layout, dtype)), i
        assert m.dtype == torch.uint8 and torch.equal(m, ref[i][1])  # masks: class ids, untouched


@pytest.mark.timeout(120)
def test_unequal_sizes_listed_are_each_made_model_ready(photo_url: str) -> None:
    opts = {"augment": [RandomHorizontalFlip()], "ragged": "list"}
    ref = reference(photo_url, **opts)
    got = reference(photo_url, normalize=(MEAN, STD), layout="NCHW", **opts)
    assert len({tuple(im.shape) for im, _ in got.values()}) > 1
    for i, (im, m) in got.items():
        assert torch.equal(im, by_hand(ref[i][0], "NCHW")) and torch.equal(m, ref[i][1])


@pytest.mark.timeout(240)
def test_fanout_workers_and_dataloader_workers_deliver_the_same_model_ready_batches(photo_url: str) -> None:
    opts = {"shuffle": True, "seed": 11, "augment": CROP, "decode": "cpu"}
    ready = {"normalize": (MEAN, STD), "layout": "NCHW", "dtype": torch.bfloat16}
    one = by_row(list(AsyncLoader(DeepLakeSource(photo_url), 8, **opts)))
    with AsyncLoader(DeepLakeSource(photo_url), 8, processes=2, **opts, **ready) as fan:
        fanned = by_row(list(fan))
    ds = AsyncIterableDataset(DeepLakeSource(photo_url), batch_size=8, **opts, **ready)
    workers = by_row(list(DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)))
    for got in (fanned, workers):
        assert got.keys() == one.keys()
        for i, (im, m) in got.items():
            assert im.dtype == torch.bfloat16 and torch.equal(im, by_hand(one[i][0], "NCHW", torch.bfloat16))
            assert torch.equal(m, one[i][1])


def test_the_device_stage_finish_makes_the_batch_model_ready_after_the_geometry(photo_url: str) -> None:
    src = DeepLakeSource(photo_url).open()
    ready = ModelReady.of((MEAN, STD), "NCHW", torch.bfloat16)
    stage = decode.DecodeStage(src.image_columns(), frozenset({"images"}), Augment(CROP), seed=3, device="cpu")
    ds = deeplake.open_read_only(photo_url)
    rows = list(range(16))
    values = {"images": [ds[i].get_bytes("images") for i in rows], "masks": [ds[i]["masks"] for i in rows]}
    plain, _ = gpu.finish(stage, gpu.pack(stage, ("images", "masks"), values, rows), with_index=False)
    got, _ = gpu.finish(
        dataclasses.replace(stage, ready=ready), gpu.pack(stage, ("images", "masks"), values, rows), with_index=False
    )
    assert torch.equal(got["images"], by_hand(plain["images"], "NCHW", torch.bfloat16))
    assert got["masks"].dtype == torch.uint8 and torch.equal(got["masks"], plain["masks"])


@pytest.mark.timeout(120)
def test_device_feed_makes_the_loaders_image_columns_model_ready(photo_url: str) -> None:
    ref = reference(photo_url, augment=[Resize(48)])
    loader = AsyncLoader(DeepLakeSource(photo_url), 8, decode="cpu", seed=5, augment=[Resize(48)])
    with DeviceFeed(loader, "cpu", normalize=(MEAN, STD), layout="NCHW", dtype=torch.float16) as feed:
        got = by_row(list(feed))
    assert got.keys() == ref.keys()
    for i, (im, m) in got.items():
        assert torch.equal(im, by_hand(ref[i][0], "NCHW", torch.float16)) and torch.equal(m, ref[i][1])
    with pytest.raises(ConfigError, match=r"needs images=\[column, \.\.\.\]"):
        DeviceFeed(iter([]), "cpu", normalize=(MEAN, STD))


# -- bad settings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"normalize": ((0.5, 0.5), (0.2, 0.2, 0.2))}, r"normalize=.* mean has 2 values and std 3"),
        ({"normalize": (MEAN, (0.2, 0.0, 0.2))}, r"normalize=.* a std of 0 divides by zero"),
        ({"normalize": (0.5, 0.2)}, r"normalize mean=0\.5 is not allowed: a list of finite numbers"),
        ({"normalize": MEAN}, r"normalize=.* is not allowed: \(mean, std\)"),
        ({"layout": "CHW"}, r"layout='CHW' is not allowed: 'NHWC' or 'NCHW'"),
        ({"dtype": torch.int32}, r"dtype=torch\.int32 is not allowed: .* not integers"),
        ({"dtype": torch.uint8}, r"dtype=torch\.uint8 is not allowed"),
        ({"dtype": "float32"}, r"dtype='float32' is not allowed"),
    ],
)
def test_bad_settings_are_named(photo_url: str, settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AsyncLoader(DeepLakeSource(photo_url), 8, **settings)
    with pytest.raises(ConfigError, match=message):
        DeviceFeed(iter([]), "cpu", images=["images"], **settings)


@pytest.mark.timeout(60)
def test_a_mean_of_the_wrong_channel_count_is_named_with_the_column_at_the_first_batch(photo_url: str) -> None:
    loader = AsyncLoader(
        DeepLakeSource(photo_url), 8, decode="cpu", augment=[Resize(48)], normalize=((0.5,) * 4, (0.2,) * 4)
    )
    with pytest.raises(
        ConfigError, match=r"normalize=.* for column 'images': it has 3 channels but mean and std have 4"
    ):
        next(iter(loader))


def test_model_ready_settings_need_an_image_column_and_no_transform(photo_url: str) -> None:
    with pytest.raises(ConfigError, match=r"none of the columns masks is an image"):
        next(iter(AsyncLoader(DeepLakeSource(photo_url, columns=["masks"]), 8, normalize=(MEAN, STD))))
    with pytest.raises(ConfigError, match=r"not allowed with a transform or collate_fn"):
        AsyncLoader(DeepLakeSource(photo_url), 8, normalize=(MEAN, STD), transform=lambda s: s)


# -- on a GPU ----------------------------------------------------------------------------------------


def _cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
@pytest.mark.timeout(120)
def test_on_the_device_the_lookup_equals_the_cpu_lookup() -> None:
    x = torch.randint(0, 256, (4, 33, 17, 3), dtype=torch.uint8)
    for layout in ("NHWC", "NCHW"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            ready = ModelReady.of((MEAN, STD), layout, dtype)
            assert ready is not None
            assert torch.equal(ready.apply(x.cuda(), "images").cpu(), ready.apply(x, "images"))


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="needs CUDA")
@pytest.mark.timeout(120)
def test_device_feed_on_cuda_delivers_model_ready_batches(photo_url: str) -> None:
    ref = reference(photo_url, augment=[Resize(48)])
    loader = AsyncLoader(DeepLakeSource(photo_url), 8, decode="cpu", seed=5, augment=[Resize(48)])
    with DeviceFeed(loader, "cuda", normalize=(MEAN, STD), layout="NCHW", dtype=torch.bfloat16) as feed:
        for b in feed:
            assert b["images"].is_cuda and b["images"].dtype == torch.bfloat16
            for i, im in zip(b["index"].tolist(), b["images"], strict=True):
                assert torch.equal(im.cpu(), by_hand(ref[i][0], "NCHW", torch.bfloat16))
