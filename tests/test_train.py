"""The training job: config validation, a tiny in-process run, resume, and two ranks under torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from asyncload import AsyncIterableDataset, AsyncLoader, ConfigError, DeepLakeSource, Resize, make_dataset
from asyncload.runtime.settings import load_config, parse_overrides, setting, validate
from asyncload.tools.synthetic import CLASSES
from asyncload.tools.train import RangeSource, TrainConfig, UNet, cuda_index_for_rank, main, train
from asyncload.tools.train.config import CONFIG_DIR
from asyncload.tools.train.data import SyncSegmentation, split_augment

from .conftest import live_children, wait_no_loop_threads

REPO = Path(__file__).resolve().parents[1]
ROWS, SIZE = 64, 32
PHOTO_ROWS, PHOTO_SIZES, CROP = 96, (40, 96), 32
KEYS = ", ".join(f.name for f in dataclasses.fields(TrainConfig))


@pytest.fixture(scope="module")
def tiny_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """64 rows of 32x32: train rows [0, 48), validation rows [48, 64) with holdout 0.25."""
    return make_dataset(str(tmp_path_factory.mktemp("train") / "tiny"), ROWS, height=SIZE, width=SIZE, progress=False)


@pytest.fixture(scope="module")
def photos_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """96 photo-like rows of many sizes (long side 40-96 px): JPEG images, PNG masks."""
    return make_dataset(
        str(tmp_path_factory.mktemp("train") / "photos"), PHOTO_ROWS, sizes=PHOTO_SIZES, image_format="jpg",
        mask_format="png", progress=False,
    )  # fmt: skip


def tiny(url: str, tmp: Path, **kw: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        data=url, make_data=False, rows=0, image_size=SIZE, batch_size=8, epochs=1, holdout=0.25, width=8, lr=3e-3,
        concurrency=16, checkpoint=str(tmp / "ck.pt"), progress=False, threads=1, model_only_steps=0,
        device="cpu",  # these tests mean the CPU, also on a machine with a GPU
    )  # fmt: skip
    base.update(kw)
    return TrainConfig(**base)


# -- configuration -----------------------------------------------------------------------------------


@pytest.mark.timeout(20)
def test_unknown_key_names_the_key_the_value_and_the_known_keys(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_config({"epoch": 3}, TrainConfig)
    assert (
        str(e.value) == f"TrainConfig: epoch=3 is not allowed: unknown key (did you mean 'epochs'?); known keys: {KEYS}"
    )

    path = tmp_path / "c.yaml"
    path.write_text("zzz_unrelated: yes\n")
    with pytest.raises(ConfigError) as e:
        load_config(path, TrainConfig)
    assert str(e.value) == f"{path}: zzz_unrelated=True is not allowed: unknown key; known keys: {KEYS}"


@pytest.mark.timeout(20)
def test_wrong_types_name_the_key_the_value_and_what_is_allowed(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    cases = {
        "lr: fast": "lr='fast' is not allowed: a number > 0",
        "batch_size: true": "batch_size=True is not allowed: an int >= 1",
        "epochs: 2.5": "epochs=2.5 is not allowed: an int >= 1",
        "loader: threads": "loader='threads' is not allowed: one of 'asyncload', 'sync'",
        "resume: 1": "resume=1 is not allowed: true or false",
        "checkpoint: 5": "checkpoint=5 is not allowed: a string or null",
        "device: gpu": "device='gpu' is not allowed: 'auto', 'cpu', 'cuda' or 'cuda:N'",
    }
    for text, message in cases.items():
        path.write_text(text + "\n")
        with pytest.raises(ConfigError) as e:
            load_config(path, TrainConfig)
        assert str(e.value) == f"{path}: {message}"


@pytest.mark.timeout(20)
def test_impossible_values_name_the_key_the_value_and_the_range() -> None:
    cases = {
        "epochs": (-1, "epochs=-1 is not allowed: an int >= 1"),
        "lr": (-0.5, "lr=-0.5 is not allowed: a number > 0"),
        "num_workers": (-2, "num_workers=-2 is not allowed: an int >= 0 (DataLoader worker processes)"),
        "holdout": (1.0, "holdout=1.0 is not allowed: a number > 0 and < 1 (fraction of rows held out for validation)"),
        "image_size": (
            4,
            "image_size=4 is not allowed: an int >= 8 (height and width of made images, and of validation images, "
            "resized to it)",
        ),
        "processes": (
            -1,
            "processes=-1 is not allowed: an int >= 0 (AsyncLoader worker processes of the training split; 0: read "
            "in this process)",
        ),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config({key: value}, TrainConfig)
        assert str(e.value) == f"TrainConfig: {message}"
        with pytest.raises(ConfigError) as e:
            TrainConfig(**{key: value})  # built in Python: checked the same way
        assert str(e.value) == message
    for clash in ({"loader": "sync"}, {"num_workers": 2}):
        with pytest.raises(ConfigError) as e:
            load_config({"processes": 2, **clash}, TrainConfig)
        assert str(e.value) == (
            "TrainConfig: processes=2 is not allowed: 0 with loader: sync or num_workers > 0 (processes are "
            "AsyncLoader's own workers, used instead of DataLoader's)"
        )


@pytest.mark.timeout(20)
def test_the_shipped_yaml_is_the_defaults_and_overrides_are_typed() -> None:
    path = CONFIG_DIR / "train_unet.yaml"
    assert load_config(path, TrainConfig) == TrainConfig()
    over = parse_overrides(["lr=0.01", "loader=sync", "checkpoint=null", "epochs=2"])
    assert over == {"lr": 0.01, "loader": "sync", "checkpoint": None, "epochs": 2}
    cfg = load_config(path, TrainConfig, over)
    assert (cfg.lr, cfg.loader, cfg.checkpoint, cfg.epochs) == (0.01, "sync", None, 2)
    assert load_config(path, TrainConfig, {"lr": 1}).lr == 1.0 and isinstance(
        load_config(None, TrainConfig, {"lr": 1}).lr, float
    )
    with pytest.raises(ConfigError) as e:
        parse_overrides(["epochs"])
    assert str(e.value) == "--set='epochs' is not allowed: KEY=VALUE, e.g. --set epochs=3"


@pytest.mark.timeout(20)
def test_command_line_reports_a_bad_setting_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(CONFIG_DIR / "train_unet.yaml"), "--set", "epochs=-1"]) == 2
    assert (
        capsys.readouterr().err
        == f"asyncload train: {CONFIG_DIR / 'train_unet.yaml'}: epochs=-1 is not allowed: an int >= 1\n"
    )


@pytest.mark.timeout(20)
def test_augmentation_settings_name_the_setting_and_the_range(capsys: pytest.CaptureFixture[str]) -> None:
    cases = {
        "crop_scale": (
            [0.5, 2],
            "crop_scale=(0.5, 2) is not allowed: [min, max] with 0 < min <= max <= 1 (crop area, a fraction of the "
            "image's)",
        ),
        "crop_ratio": (
            [1.5, 0.5],
            "crop_ratio=(1.5, 0.5) is not allowed: [min, max] with 0 < min <= max (crop width / height)",
        ),
        "crop": (
            4,
            "crop=4 is not allowed: null or an int >= 8 (side of random resized crops; null: resize to image_size)",
        ),
        "flip": (1.5, "flip=1.5 is not allowed: a number in [0, 1] (probability of a horizontal flip)"),
        "make_sizes": (
            [640, 240],
            "make_sizes=(640, 240) is not allowed: null or [min, max] with 8 <= min <= max (long side of made photos)",
        ),
        "make_aspect": (
            [0, 1],
            "make_aspect=(0, 1) is not allowed: [min, max] with 0 < min <= max (width / height of made photos)",
        ),
    }
    for key, (value, message) in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config({key: value}, TrainConfig)
        assert str(e.value) == f"TrainConfig: {message}"
    with pytest.raises(ConfigError, match=r"^crop_scale=0.5 is not allowed: \[min, max\]"):
        TrainConfig(crop_scale=0.5)  # type: ignore[arg-type]  # built in Python: checked the same way
    assert main(["--set", "crop_scale=[0, 1]"]) == 2
    # without --config, the shipped train_unet.yaml: the message names it
    assert capsys.readouterr().err.startswith(
        f"asyncload train: {CONFIG_DIR / 'train_unet.yaml'}: crop_scale=(0, 1) is not allowed: [min"
    )


@pytest.mark.timeout(20)
def test_the_photo_config_trains_on_crops_and_validates_on_resized_images() -> None:
    cfg = load_config(CONFIG_DIR / "train_unet_photos.yaml", TrainConfig)
    assert (cfg.make_sizes, cfg.make_format, cfg.make_mask_format) == ((240, 640), "jpg", "png")
    assert [repr(op) for op in split_augment(cfg, train=True)] == [
        "RandomResizedCrop(size=(96, 96), scale=(0.25, 1.0), ratio=(0.75, 1.333), interpolation='auto')",
        "RandomHorizontalFlip(p=0.5)",
    ]
    assert split_augment(cfg, train=False) == [Resize(96)]
    assert split_augment(TrainConfig(), train=True) == [Resize(64)]  # the defaults: no crop, no flip


@dataclass(frozen=True)
class _Other:
    """Another config, as another engineer would write one: the helper is not tied to training."""

    name: str
    sizes: tuple[int, ...] = (1, 2)
    mode: Literal["a", "b"] = "a"
    limit: float | None = setting(None, "null or a number >= 0", lambda v: v is None or v >= 0)

    def __post_init__(self) -> None:
        validate(self)


@pytest.mark.timeout(20)
def test_the_helper_serves_other_dataclasses(tmp_path: Path) -> None:
    path = tmp_path / "o.yaml"
    path.write_text("name: x\nsizes: [3, 4]\nlimit: 2\n")
    assert load_config(path, _Other) == _Other("x", (3, 4), "a", 2.0)
    with pytest.raises(ConfigError) as e:
        load_config({"sizes": [1]}, _Other)
    assert str(e.value) == "_Other: name is missing: a string is required"
    with pytest.raises(ConfigError) as e:
        load_config({"name": "x", "sizes": [1, "two"]}, _Other)
    assert str(e.value) == "_Other: sizes=(1, 'two') is not allowed: a list of an int"
    with pytest.raises(ConfigError) as e:
        load_config({"name": "x", "limit": -1}, _Other)
    assert str(e.value) == "_Other: limit=-1.0 is not allowed: null or a number >= 0"


# -- training ----------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_range_source_serves_exactly_its_rows_named_by_dataset_row(tiny_url: str) -> None:
    import deeplake
    import numpy as np

    ds = deeplake.open_read_only(tiny_url)
    split = RangeSource(DeepLakeSource(tiny_url), 48, 64)
    assert len(split) == 16
    batches = list(AsyncLoader(split, batch_size=5, shuffle=True, seed=2))
    assert sorted(i for b in batches for i in b["index"].tolist()) == list(range(48, 64))  # dataset rows
    for b in batches:
        for i, image in zip(b["index"].tolist(), b["images"], strict=True):
            assert np.array_equal(image.numpy(), np.array(ds[i]["images"]))
    with pytest.raises(ValueError, match=r"RangeSource: \[60, 65\) is not within the 64 rows of file://"):
        RangeSource(DeepLakeSource(tiny_url), 60, 65)


@pytest.mark.timeout(20)
def test_unet_takes_uint8_batches_of_any_size_and_returns_class_logits() -> None:
    net = UNet(classes=len(CLASSES), width=4).eval()
    for h, w in ((32, 32), (42, 54), (9, 13)):
        images = torch.randint(0, 256, (2, h, w, 3), dtype=torch.uint8)
        assert net(images).shape == (2, len(CLASSES), h, w)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loader", ["asyncload", "sync"])
def test_a_few_steps_train_evaluate_and_checkpoint(tiny_url: str, tmp_path: Path, loader: str) -> None:
    cfg = tiny(tiny_url, tmp_path, loader=loader, max_steps_per_epoch=3)
    steps: list[dict[str, Any]] = []
    threads = torch.get_num_threads()
    (row,) = train(cfg, on_step=steps.append)
    assert torch.get_num_threads() == threads  # cfg.threads=1 held for the run only
    assert [s["step"] for s in steps] == [1, 2, 3] and all(len(s["indices"]) == 8 for s in steps)
    assert row["epoch"] == 0 and row["step"] == 3 and row["samples"] == 24
    assert math.isfinite(row["loss"]) and 0.0 <= row["miou"] <= 1.0
    assert 0.0 < row["data_wait"] < 1.0 and row["samples_per_s"] > 0
    assert row["device_sync"] == 0.0  # the CPU never queues work
    ck = torch.load(cfg.checkpoint, weights_only=True)
    assert (ck["epoch"], ck["step"], ck["step_in_epoch"]) == (1, 3, 0)
    assert set(ck) >= {"model", "optimizer", "config", "loader"}
    wait_no_loop_threads()


@pytest.mark.timeout(90)  # ~7 s idle, 20 s on a loaded 2-core machine: spawn workers import torch
def test_processes_2_trains_every_sample_of_each_epoch_once_on_spawn_workers(tiny_url: str, tmp_path: Path) -> None:
    """``processes: 2``: the training split is read by two persistent spawn workers (AsyncLoader's
    fan-out) on the CPU, the same two in both epochs; each epoch trains each of the 48 rows once, in a
    new order, and the workers are gone when the job returns."""
    steps: list[dict[str, Any]] = []
    workers: list[list[int]] = []

    before = {p.pid for p in live_children()}  # an earlier test's reader still finishing a held-up read

    def on_step(s: dict[str, Any]) -> None:
        steps.append(s)
        # The fan-out's workers; the held-out split's Deep Lake reader process comes and goes beside them.
        kids = multiprocessing.active_children()
        workers.append(sorted(p.pid for p in kids if p.pid not in before and p.name != "asyncload-reader"))

    rows = train(tiny(tiny_url, tmp_path, processes=2, epochs=2), on_step=on_step)
    assert len(workers[0]) == 2 and all(w == workers[0] for w in workers)  # started once, kept
    assert [s["step"] for s in steps] == list(range(1, 13)) and [r["samples"] for r in rows] == [48, 48]
    orders = [[i for s in steps if s["epoch"] == e for i in s["indices"]] for e in (0, 1)]
    assert all(sorted(order) == list(range(48)) for order in orders) and orders[0] != orders[1]
    assert all(0.0 < r["data_wait"] < 1.0 and r["samples_per_s"] > 0 for r in rows)
    assert not {p.pid for p in live_children()} - before
    wait_no_loop_threads()


@pytest.mark.timeout(60)
def test_resume_continues_at_the_saved_epoch_and_step(tiny_url: str, tmp_path: Path) -> None:
    (first,) = train(tiny(tiny_url, tmp_path, max_steps_per_epoch=2))
    assert first["step"] == 2
    steps: list[int] = []
    rows = train(tiny(tiny_url, tmp_path, max_steps_per_epoch=2, epochs=3), on_step=lambda s: steps.append(s["step"]))
    assert [r["epoch"] for r in rows] == [1, 2] and steps == [3, 4, 5, 6]
    assert train(tiny(tiny_url, tmp_path, max_steps_per_epoch=2, epochs=3)) == []  # already done
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert (ck["epoch"], ck["step"]) == (3, 6)


class _Crash(Exception):
    pass


@pytest.mark.timeout(120)  # processes=2 starts workers three times: ~25 s on a loaded 2-core machine
@pytest.mark.parametrize(("loader", "processes"), [("asyncload", 0), ("sync", 0), ("asyncload", 2)])
def test_mid_epoch_resume_trains_exactly_the_rest_of_the_epoch(
    tiny_url: str, tmp_path: Path, loader: str, processes: int
) -> None:
    """Interrupted after step 3 with a checkpoint at step 2: the resumed run trains the batches of steps
    3..6 of the uninterrupted run, in its order (the loader's resume state, or a replayed order). With
    ``processes: 2`` the state counts the steps trained, not the batches the device feed took ahead."""
    reference: list[dict[str, Any]] = []
    train(tiny(tiny_url, tmp_path / "ref", loader=loader, processes=processes), on_step=reference.append)
    assert len(reference) == 6  # 48 training rows, batches of 8

    def crash_after_3(s: dict[str, Any]) -> None:
        if s["step"] == 3:
            raise _Crash

    cfg = tiny(tiny_url, tmp_path, loader=loader, processes=processes, checkpoint_every=2)
    with pytest.raises(_Crash):
        train(cfg, on_step=crash_after_3)
    ck = torch.load(cfg.checkpoint, weights_only=True)
    assert (ck["epoch"], ck["step"], ck["step_in_epoch"]) == (0, 2, 2)
    # asyncload resumes through the loader's own state when it has one; the sync baseline replays
    assert (ck["loader"] is not None) == (loader == "asyncload" and hasattr(AsyncIterableDataset, "state_dict"))
    resumed: list[dict[str, Any]] = []
    (row,) = train(cfg, on_step=resumed.append)
    assert [s["step"] for s in resumed] == [3, 4, 5, 6] and row["steps"] == 4
    assert [s["indices"] for s in resumed] == [s["indices"] for s in reference[2:]]
    wait_no_loop_threads()


@pytest.mark.timeout(120)
def test_two_ranks_under_torchrun_cover_each_epoch_once(tiny_url: str, tmp_path: Path) -> None:
    log = tmp_path / "indices"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "asyncload.train", "--config", str(CONFIG_DIR / "train_unet.yaml"),
        "--set", f"data={tiny_url}", "--set", "make_data=false", "--set", "rows=0", "--set", "image_size=32",
        "--set", "batch_size=8", "--set", "epochs=2", "--set", "holdout=0.25", "--set", "width=8",
        "--set", "progress=false",
        "--set", f"checkpoint={tmp_path / 'ck.pt'}", "--set", f"index_log={log}",
        "--set", "device=cpu",  # two ranks on the CPU (gloo), also on a machine with one GPU
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stdout and proc.stdout.count("epoch 2/2") == 1  # rank 0 logs, alone
    ranks = [[json.loads(line) for line in (log / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    for epoch in (0, 1):
        a, b = (ranks[r][epoch]["indices"] for r in (0, 1))
        assert ranks[0][epoch]["world_size"] == 2 and len(a) == len(b) == 24  # equal batches on every rank
        assert sorted(a + b) == list(range(48))  # the union is the epoch, each sample once
    assert ranks[0][0]["indices"] != ranks[0][1]["indices"]  # reshuffled per epoch
    ck = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert (ck["epoch"], ck["step"]) == (2, 6)


@pytest.mark.timeout(20)
def test_more_ranks_than_gpus_is_a_config_error_naming_both_counts() -> None:
    assert [cuda_index_for_rank("auto", r, 2, 2) for r in (0, 1)] == [0, 1]
    with pytest.raises(ConfigError) as e:
        cuda_index_for_rank("auto", 1, 2, 1)
    assert str(e.value) == (
        "device='auto' is not allowed: 2 rank(s) run on this machine but it has 1 CUDA device(s); "
        "start at most 1 per machine (torchrun --nproc_per_node=1) or set device: cpu"
    )
    with pytest.raises(
        ConfigError, match=r"^device='cuda' is not allowed: 1 rank\(s\) run on this machine but it has 0"
    ):
        cuda_index_for_rank("cuda", 0, 1, 0)


@pytest.mark.timeout(60)
def test_model_only_rate_is_reported_and_leaves_the_model_as_it_was(tiny_url: str, tmp_path: Path) -> None:
    (row,) = train(tiny(tiny_url, tmp_path, max_steps_per_epoch=2, model_only_steps=4))
    assert row["model_only_samples_per_s"] > 0 and row["of_model_only"] == pytest.approx(
        row["samples_per_s"] / row["model_only_samples_per_s"]
    )
    # The timed steps trained on a copy of nothing: the checkpoint (saved before) matches the weights
    # a run without the measurement ends with.
    (plain,) = train(tiny(tiny_url, tmp_path / "plain", max_steps_per_epoch=2))
    assert "model_only_samples_per_s" not in plain
    a = torch.load(tmp_path / "ck.pt", weights_only=True)["model"]
    b = torch.load(tmp_path / "plain" / "ck.pt", weights_only=True)["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


# -- photo-like data of many sizes ------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("loader", ["asyncload", "sync"])
def test_variable_size_photos_train_on_random_crops_and_report_miou(
    photos_url: str, tmp_path: Path, loader: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """JPEG photos of many sizes with PNG masks: training reads random 32x32 crops (flipped half the
    time), validation the whole image resized to 32x32; both loaders batch them and report IoU."""
    cfg = tiny(photos_url, tmp_path, loader=loader, image_size=CROP, crop=CROP, flip=0.5, epochs=2)
    rows = train(cfg)
    assert [r["samples"] for r in rows] == [72, 72]  # 72 training rows per epoch
    for r in rows:
        present = [v for v in r["iou"].values() if not math.isnan(v)]
        assert list(r["iou"]) == list(CLASSES) and len(present) == len(CLASSES)  # every class in the 24 rows
        assert r["miou"] == pytest.approx(sum(present) / len(present))
        assert 0.0 <= r["miou"] <= 1.0 and r["iou"]["background"] > 0.5
    assert rows[1]["loss"] < rows[0]["loss"]
    out = capsys.readouterr().out
    assert "train: crop 32x32 (scale 0.25-1, ratio 0.75-1.333), flip 0.5, validate: resize to 32x32" in out
    assert f"mIoU {rows[1]['miou']:.3f} (background " in out


@pytest.mark.timeout(30)
def test_the_sync_baseline_applies_asyncloads_draws_to_each_sample(photos_url: str) -> None:
    """The same crop, flip and resize per (seed, epoch, row) in both loaders, so a comparison of the two
    compares loaders: masks agree (nearest neighbour), images up to resampling and JPEG decoder."""
    ops = split_augment(TrainConfig(image_size=CROP, crop=CROP, flip=0.5), train=True)
    loader = AsyncLoader(RangeSource(DeepLakeSource(photos_url), 16, 48), 8, shuffle=True, seed=3, augment=ops)
    sync = SyncSegmentation(photos_url, 16, 48, augment=ops, seed=3)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        sync.set_epoch(epoch)
        for batch in loader:
            for i, image, mask in zip(batch["index"].tolist(), batch["images"], batch["masks"], strict=True):
                mine = sync[i - 16]
                assert mine["images"].shape == image.shape == (CROP, CROP, 3)
                assert mine["masks"].shape == mask.shape == (CROP, CROP)
                assert (mine["masks"] == mask).float().mean() > 0.98
                assert (mine["images"].float() - image.float()).abs().mean() < 4


@pytest.mark.timeout(30)
def test_on_data_of_image_size_the_resize_leaves_the_stored_pixels(tiny_url: str) -> None:
    import deeplake
    import numpy as np

    ds = deeplake.open_read_only(tiny_url)
    sync = SyncSegmentation(tiny_url, 48, 64, augment=[Resize(SIZE)])
    (batch,) = list(AsyncLoader(RangeSource(DeepLakeSource(tiny_url), 48, 64), 16, augment=[Resize(SIZE)]))
    for k, i in enumerate(batch["index"].tolist()):
        stored = np.array(ds[i]["images"]), np.array(ds[i]["masks"])
        assert np.array_equal(sync[i - 48]["images"].numpy(), stored[0])
        assert np.array_equal(sync[i - 48]["masks"].numpy(), stored[1])
        assert np.array_equal(batch["images"][k].numpy(), stored[0])
        assert np.array_equal(batch["masks"][k].numpy(), stored[1])


# -- CUDA --------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fast", [True, False])
def test_cuda_training_with_and_without_bf16_and_channels_last(tiny_url: str, tmp_path: Path, fast: bool) -> None:
    cfg = tiny(tiny_url, tmp_path, device="cuda", bf16=fast, channels_last=fast, model_only_steps=10)
    (row,) = train(cfg)
    assert math.isfinite(row["loss"]) and 0.0 <= row["miou"] <= 1.0
    assert 0.0 <= row["data_wait"] < 1.0 and 0.0 < row["device_sync"] < 1.0
    assert row["model_only_samples_per_s"] > 0
    ck = torch.load(cfg.checkpoint, weights_only=True)
    assert all(v.dtype != torch.bfloat16 for v in ck["model"].values())  # autocast leaves fp32 weights


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(120)
def test_more_ranks_than_gpus_under_torchrun_fails_with_both_counts(tiny_url: str, tmp_path: Path) -> None:
    ranks = torch.cuda.device_count() + 1
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
        "-m", "asyncload.train", "--set", f"data={tiny_url}", "--set", "make_data=false", "--set", "progress=false",
        "--set", f"checkpoint={tmp_path / 'ck.pt'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert proc.returncode != 0
    assert (
        f"device='auto' is not allowed: {ranks} rank(s) run on this machine but it has {ranks - 1} CUDA device(s)"
        in proc.stderr
    ), proc.stderr[-3000:]
    assert "invalid device ordinal" not in proc.stderr.lower()


# -- model-ready batches (issue 23) -------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_model_ready_batches_are_unets_prepare_and_train_without_the_step_converting(
    tiny_url: str, tmp_path: Path
) -> None:
    from asyncload.tools.train.data import Split
    from asyncload.tools.train.steps import StepOptions

    cfg = tiny(tiny_url, tmp_path, model_ready=True, decode="cpu", max_steps_per_epoch=2)
    plain = tiny(tiny_url, tmp_path, decode="cpu")
    with (
        contextlib.closing(Split(cfg, tiny_url, 0, 16, train=False, rank=0, world=1)) as ready,
        contextlib.closing(Split(plain, tiny_url, 0, 16, train=False, rank=0, world=1)) as raw,
    ):
        a, b = next(iter(ready.epoch(0))), next(iter(raw.epoch(0)))
    assert a["images"].dtype == torch.float32 and a["images"].shape == (8, 3, SIZE, SIZE)
    assert torch.allclose(a["images"], UNet.prepare(b["images"]), atol=1e-5, rtol=0)
    assert torch.equal(a["masks"], b["masks"])
    how = StepOptions(torch.device("cpu"))
    assert how.inputs(a["images"]).data_ptr() == a["images"].data_ptr()  # fed as it came: no conversion
    (row,) = train(cfg)
    assert row["step"] == 2 and math.isfinite(row["loss"]) and 0.0 <= row["miou"] <= 1.0
