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
from asyncload.processes.fanout import FanoutIterator
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


def stage_of(url: str, device: str, ops: list | None) -> tuple[decode.DecodeStage, dict[str, list], list[int]]:
    src = DeepLakeSource(url)
    stage = decode.DecodeStage(
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


# -- the fan-out's device threads, on the CPU -------------------------------------------------------------


def device_pool(url: str, processes: int, **opts):  # noqa: ANN201 - a WorkerPool
    """A fan-out pool whose workers ship packed batches (``decode="cuda"``) and whose training-process
    stage runs on the CPU: the window of device threads, as on a GPU node, without one."""
    from asyncload.engine.sampler import Shard
    from asyncload.processes.fanout import WorkerPool

    kw = {"batch_size": 4, "decode": "cuda", "augment": CROP, "shuffle": True, "seed": 5, **opts}
    pool = WorkerPool(DeepLakeSource(url), kw, Shard(), processes)  # forkserver, the default
    pool.gpu_stage = dataclasses.replace(pool.gpu_stage, device="cpu")
    return pool


def one_process(pool, epoch: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """The epoch's batches as one process's device stage makes them (``gpu.run`` on each batch's rows)."""
    ds = deeplake.open_read_only(pool.url)
    stage = pool.gpu_stage.for_epoch(epoch)
    out = []
    for rows in pool.sampler.batches(epoch):
        values = {c: [ds[i].get_bytes(c) for i in rows] for c in ("images", "masks")}
        got, _, _ = gpu.run(stage, ("images", "masks"), values, rows)
        out.append((list(rows), got["images"], got["masks"]))
    return out


def device_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("asyncload-device")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("processes", [2, 3])
def test_fanout_device_threads_yield_the_batches_one_process_makes(photo_url: str, processes: int) -> None:
    pool = device_pool(photo_url, processes)
    try:
        for epoch in (0, 1):
            want = one_process(pool, epoch)
            with FanoutIterator(pool, epoch) as it:
                got = [next(it)]
                assert device_threads()  # decoded on the epoch's device threads, not the consumer's
                got += list(it)
            assert [b["index"].tolist() for b in got] == [rows for rows, _, _ in want]
            for b, (_, images, masks) in zip(got, want, strict=True):
                assert torch.equal(b["images"], images) and torch.equal(b["masks"], masks)
            assert device_threads() == []  # the epoch's end stopped them
    finally:
        pool.close()


@pytest.mark.timeout(180)
def test_fanout_device_window_marks_a_batch_consumed_only_when_it_is_yielded(photo_url: str) -> None:
    from asyncload.engine.progress import EpochProgress

    pool = device_pool(photo_url, 2)
    try:
        n = len(pool.sampler.batches(0))
        progress = EpochProgress(0, n)
        it = FanoutIterator(pool, 0, progress=progress)
        # At least 3 batches, and on until some are taken ahead of the consumer (how many are ahead after
        # a given next() depends on how fast the workers answered: after exactly 3, none was, 3 runs in 10)
        first: list[list[int]] = []
        while len(first) < 3 or not it._ahead:
            assert len(first) < n - 1, "no batch was ever taken ahead of the consumer"
            first.append(next(it)["index"].tolist())
        assert len(it._ahead) >= 1  # batches taken ahead of the consumer...
        assert (progress.next, progress.extra) == (len(first), set())  # ...are not counted as consumed
        it.close()
        assert device_threads() == []
        with FanoutIterator(pool, 0, skip=frozenset(range(len(first)))) as rest:  # as ``AsyncLoader`` resumes it
            later = [b["index"].tolist() for b in rest]
        assert first + later == [list(b) for b in pool.sampler.batches(0)]
    finally:
        pool.close()


@pytest.mark.timeout(180)
def test_fanout_device_window_raises_a_bad_batch_at_its_turn(tmp_path) -> None:
    url = make(str(tmp_path / "bad"), 24, image_format="jpg", mask_format="lz4")
    ds = deeplake.open(url)
    ds[13]["images"] = ds[13].get_bytes("images")[:-400]  # cut short: no EOI, libjpeg-turbo refuses it
    ds.commit()
    pool = device_pool(url, 2, augment=[Resize(32)], shuffle=False)
    try:
        with FanoutIterator(pool, 0) as it:
            seen = []
            with pytest.raises(ReadError, match=r"\[13\].*libjpeg-turbo"):
                for b in it:
                    seen.append(b["index"].tolist())
        assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # every batch before it, in order
        assert device_threads() == []
    finally:
        pool.close()


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


def test_decode_cuda_without_torchvision_names_the_gpu_extra_where_the_loader_is_built(
    photo_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a bare ``ModuleNotFoundError`` at the first batch (or in a DataLoader worker): a ``ConfigError``
    from the constructor that says what to install."""
    from asyncload import AsyncIterableDataset, ConfigError

    monkeypatch.setitem(__import__("sys").modules, "torchvision", None)  # as if not installed
    want = "decode='cuda' needs torchvision (nvJPEG is called through torchvision.io.decode_jpeg), which is not installed: pip install 'torch-asyncload[gpu]'"  # fmt: skip
    with pytest.raises(ConfigError) as info:
        AsyncLoader(DeepLakeSource(photo_url), 4, decode="cuda")
    assert str(info.value).startswith(want)
    with pytest.raises(ConfigError, match=r"^decode='cuda:1' needs torchvision .*\[gpu\]"):
        AsyncIterableDataset(DeepLakeSource(photo_url), 4, decode="cuda:1")
    assert AsyncLoader(DeepLakeSource(photo_url), 4, decode="cpu").options.decode == "cpu"  # others unaffected
