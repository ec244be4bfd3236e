"""Paired augmentation on real Deep Lake datasets of variable-size photos: image and mask keep the same
geometry through every op, the draws follow torchvision's recipe, and augmented epochs are exactly
reproducible and resumable in one process, in fan-out workers and in DataLoader workers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from asyncload import (
    AsyncIterableDataset,
    AsyncLoader,
    DeepLakeSource,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
)
from asyncload.image.augment import Augment, uniforms
from tests.photo_data import make

from .conftest import WORKER_START

ROWS = 40
CROP = [RandomResizedCrop((40, 48), scale=(0.2, 1.0)), RandomHorizontalFlip()]


@pytest.fixture(scope="module")
def aligned_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Lossless images (PNG) whose masks are a threshold of their own pixels; sizes 60–200 px a side."""
    return make(
        str(tmp_path_factory.mktemp("aug") / "png"),
        ROWS,
        image_format="png",
        mask_format="png",
        sizes=(60, 200),
        aligned=True,
    )


@pytest.fixture(scope="module")
def photo_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Photo-like JPEGs (q90) of 60–200 px a side with lz4 masks."""
    return make(
        str(tmp_path_factory.mktemp("aug") / "jpg"), ROWS, image_format="jpg", mask_format="lz4", sizes=(60, 200)
    )


def agreement(batch: dict[str, torch.Tensor]) -> float:
    """How many pixels' masks say what their image's pixels say (bright ↔ 1)."""
    bright = batch["images"][..., 0] > 125
    return float((bright == (batch["masks"] == 1)).float().mean())


@pytest.mark.parametrize(
    "ops",
    [
        CROP,
        [RandomHorizontalFlip(1.0), RandomResizedCrop(40, scale=(0.05, 0.3))],
        [Resize((50, 30))],
        [Resize(64, keep_aspect=True), RandomHorizontalFlip(1.0)],
        [RandomResizedCrop(16, scale=(0.9, 1.0))],  # shrinks a lot: the scaled-decode path for JPEG
    ],
    ids=["crop-flip", "flip-then-small-crop", "stretch", "letterbox-flip", "shrink"],
)
@pytest.mark.parametrize("decode", ["cpu", "store"])
def test_the_mask_lines_up_with_its_image_after_every_op(aligned_url: str, ops: list, decode: str) -> None:
    loader = AsyncLoader(DeepLakeSource(aligned_url), 8, shuffle=True, augment=ops, decode=decode)
    seen = 0
    for b in loader:
        out = Augment(ops).out_size
        assert b["images"].shape[1:3] == b["masks"].shape[1:3] == out
        real = b["masks"] != 255  # letterbox padding is the ignore value
        bright = b["images"][..., 0] > 125
        agree = float(((bright == (b["masks"] == 1)) | ~real).float().mean())
        assert agree > 0.95, f"image and mask disagree on {1 - agree:.1%} of the pixels"
        seen += len(b["index"])
    assert seen == ROWS


def test_a_misaligned_mask_would_be_caught(aligned_url: str) -> None:
    """The check above can fail: mirror the masks alone and the agreement collapses."""
    b = next(iter(AsyncLoader(DeepLakeSource(aligned_url), 16, augment=[Resize(48)])))
    assert agreement(b) > 0.95
    assert agreement({"images": b["images"], "masks": b["masks"].flip(2)}) < 0.9


def test_letterbox_pads_images_with_fill_and_masks_with_the_ignore_value(aligned_url: str) -> None:
    op = Resize(64, keep_aspect=True, fill=7, mask_fill=254)
    b = next(iter(AsyncLoader(DeepLakeSource(aligned_url), 16, augment=[op])))
    for j in range(16):
        pad = b["masks"][j] == 254
        assert bool((b["images"][j][pad] == 7).all())
    assert bool((b["masks"] == 254).any())


def test_draws_follow_the_recipe_and_stay_inside_the_image() -> None:
    aug = Augment([RandomResizedCrop(32, scale=(0.25, 0.5), ratio=(0.5, 2.0)), RandomHorizontalFlip()])
    sizes = [(int(h), int(w)) for h, w in np.random.default_rng(0).integers(40, 400, (2000, 2))]
    draws = aug.draws(7, 3, list(range(2000)), sizes)
    fractions, flips = [], 0
    for (h, w), d in zip(sizes, draws, strict=True):
        y, x, bh, bw = d.box
        assert 0 <= y and y + bh <= h and 0 <= x and x + bw <= w and d.out == (32, 32)
        fractions.append(bh * bw / (h * w))
        flips += d.flip
    inside = np.mean([(0.24 <= f <= 0.51) for f in fractions])
    assert inside > 0.97  # the rest is the centre-crop fallback, as in torchvision
    assert 900 < flips < 1100
    assert draws == aug.draws(7, 3, list(range(2000)), sizes)  # a function of (seed, epoch, row)
    assert draws != aug.draws(7, 4, list(range(2000)), sizes)


def test_uniforms_depend_on_seed_epoch_and_row_alone() -> None:
    a = uniforms(1, 2, [5, 9, 11], 4)
    assert np.array_equal(a[1], uniforms(1, 2, [9], 4)[0])
    assert not np.array_equal(a, uniforms(2, 2, [5, 9, 11], 4)) and not np.array_equal(a, uniforms(1, 3, [5, 9, 11], 4))
    big = uniforms(0, 0, list(range(20000)), 1)
    assert 0 <= big.min() and big.max() < 1 and abs(big.mean() - 0.5) < 0.01


def by_row(batches: list[dict[str, torch.Tensor]]) -> dict[int, tuple[bytes, bytes]]:
    out = {}
    for b in batches:
        for j, i in enumerate(b["index"].tolist()):
            out[i] = (b["images"][j].numpy().tobytes(), b["masks"][j].numpy().tobytes())
    return out


def test_augmented_epochs_are_reproducible_and_differ_between_epochs(photo_url: str) -> None:
    def run(epoch: int) -> dict[int, tuple[bytes, bytes]]:
        loader = AsyncLoader(DeepLakeSource(photo_url), 8, shuffle=True, seed=3, augment=CROP)
        loader.set_epoch(epoch)
        return by_row(list(loader))

    first = run(0)
    assert sorted(first) == list(range(ROWS))
    assert run(0) == first
    second = run(1)
    assert sum(first[i] != second[i] for i in range(ROWS)) > ROWS * 0.9


def test_a_resumed_augmented_epoch_yields_exactly_the_rest(photo_url: str) -> None:
    def new() -> AsyncLoader:
        return AsyncLoader(DeepLakeSource(photo_url), 8, shuffle=True, seed=5, augment=CROP)

    full = new()
    full.set_epoch(2)
    whole = list(full)
    first = new()
    first.set_epoch(2)
    it = iter(first)
    taken = [next(it) for _ in range(2)]
    state = first.state_dict()
    it.close()
    second = new()
    second.load_state_dict(state)
    rest = list(second)
    got = taken + rest
    assert [b["index"].tolist() for b in got] == [b["index"].tolist() for b in whole]
    for a, b in zip(got, whole, strict=True):
        assert torch.equal(a["images"], b["images"]) and torch.equal(a["masks"], b["masks"])


@pytest.mark.timeout(180)
def test_fanout_workers_and_dataloader_workers_augment_exactly_as_one_process(photo_url: str) -> None:
    opts = {"shuffle": True, "seed": 11, "augment": CROP}
    one = AsyncLoader(DeepLakeSource(photo_url), 8, **opts)
    one.set_epoch(1)
    ref = by_row(list(one))
    with AsyncLoader(DeepLakeSource(photo_url), 8, processes=2, **opts) as fan:
        fan.set_epoch(1)
        assert by_row(list(fan)) == ref
    ds = AsyncIterableDataset(DeepLakeSource(photo_url), batch_size=8, **opts)
    ds.set_epoch(1)
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)
    assert by_row(list(dl)) == ref


def test_a_users_transform_runs_after_the_augmentation(photo_url: str) -> None:
    def transform(s: dict) -> dict:
        assert s["images"].shape == (40, 48, 3) and s["masks"].shape == (40, 48)
        return {
            "images": torch.from_numpy(s["images"]).permute(2, 0, 1).float() / 255,
            "masks": torch.from_numpy(s["masks"]),
        }

    b = next(iter(AsyncLoader(DeepLakeSource(photo_url), 8, augment=CROP, transform=transform)))
    assert b["images"].shape == (8, 3, 40, 48) and b["images"].dtype == torch.float32 and b["index"].shape == (8,)


def test_without_a_sizing_op_unequal_sizes_follow_ragged(photo_url: str) -> None:
    b = next(iter(AsyncLoader(DeepLakeSource(photo_url), 4, augment=[RandomHorizontalFlip()], ragged="list")))
    assert len(b["images"]) == 4 and all(t.shape[:2] == m.shape for t, m in zip(b["images"], b["masks"], strict=True))


def test_a_mask_of_another_size_than_its_image_is_named_or_skipped(tmp_path) -> None:
    import deeplake

    from asyncload import ReadError
    from tests.photo_data import encode, sample

    url = "file://" + str(tmp_path / "mismatch")
    ds = deeplake.create(url)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="png"))
    rows = [sample(np.random.default_rng(i), 48, 64) for i in range(4)]
    masks = [encode(m, "png") for _, m in rows]
    masks[2] = encode(rows[2][1][:40], "png")
    ds.append({"images": [encode(img, "jpg") for img, _ in rows], "masks": masks})
    ds.commit()
    with pytest.raises(
        ReadError,
        match=r"column 'masks' of .* at indices \[2\] failed: CollateError: column 'masks' is 40x64 but 'images' is 48x64",
    ):
        list(AsyncLoader(DeepLakeSource(url), 4, augment=[Resize(32)]))
    loader = AsyncLoader(DeepLakeSource(url), 4, augment=[Resize(32)], on_error="skip")
    assert [i for b in loader for i in b["index"].tolist()] == [0, 1, 3]
    assert [i for i, _ in loader.stats()["skipped_samples"]] == [2]


def test_ranks_augment_their_rows_exactly_as_one_process(photo_url: str) -> None:
    """Each rank of two reads its share; every row it reads has the pixels one process gives that row
    (the padding rank repeats rows of the epoch's start, with the same pixels)."""
    opts = {"shuffle": True, "seed": 2, "augment": CROP}
    one = AsyncLoader(DeepLakeSource(photo_url), 8, **opts)
    one.set_epoch(3)
    ref = by_row(list(one))
    seen: set[int] = set()
    for rank in (0, 1):
        loader = AsyncLoader(DeepLakeSource(photo_url), 8, rank=rank, world_size=2, **opts)
        loader.set_epoch(3)
        got = by_row(list(loader))
        assert all(got[i] == ref[i] for i in got)
        seen |= set(got)
    assert seen == set(range(ROWS))
