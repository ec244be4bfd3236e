"""``TrainConfig``: the training job's settings, validated before anything starts.

The shipped configs live in the package (``asyncload/tools/train/configs/*.yaml``), so ``asyncload train
--config train_unet`` works from any directory once the package is installed: ``find_config`` takes a
path, or a shipped config's name (``train_unet``, ``train_unet_photos.yaml``, or an old
``configs/train_unet.yaml`` path from a source checkout)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ...runtime.settings import check, setting, validate

#: Where the shipped configs are: inside the package, installed with it.
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def shipped_configs() -> list[str]:
    """The names of the configs that ship with the package (``train_unet``, ...)."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def find_config(name: str | os.PathLike[str]) -> Path:
    """``name`` as a file when one is there, else the shipped config of that name (``train_unet``,
    ``train_unet.yaml``, ``configs/train_unet.yaml``): scripts written against a source checkout keep
    working outside it. ``FileNotFoundError`` names the file and the shipped configs when neither exists
    (the command's exit status 1, as for any missing file)."""
    path = Path(name)
    if path.is_file():
        return path
    stem = path.name.removesuffix(".yaml").removesuffix(".yml")
    shipped = CONFIG_DIR / f"{stem}.yaml"
    if shipped.is_file():
        return shipped
    raise FileNotFoundError(
        errno.ENOENT, f"No such file or directory, nor a shipped config of that name ({', '.join(shipped_configs())})",
        os.fspath(name),
    )  # fmt: skip


def _device_ok(v: str) -> bool:
    return v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())


def _span(low: float, high: float | None = None) -> Callable[[tuple[float, float]], bool]:
    """A rule for a ``[min, max]`` pair: ``low < min <= max`` (and ``max <= high`` when given)."""
    return lambda v: low < v[0] <= v[1] and (high is None or v[1] <= high)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; the shipped ``train_unet.yaml`` holds the defaults below."""

    data: str = setting("data/synthetic-seg-64", "a non-empty path or URL of a Deep Lake dataset", lambda v: bool(v))
    make_data: bool = True  # write the synthetic dataset at ``data`` when nothing is there
    # The dataset's columns and classes. ``classes: null``: the mask column's ``class_names`` metadata
    # (Deep Lake's ClassLabel convention) when it has them, else the largest class id in the data + 1.
    # ``class_names: null``: the metadata's names, else ``class 0``, ``class 1``...
    image_column: str = setting("images", "a column name", lambda v: bool(v))
    mask_column: str = setting("masks", "a column name (uint8 class ids per pixel)", lambda v: bool(v))
    classes: int | None = setting(
        None, "null or an int >= 2 (null: from the mask column's metadata, else from the data)",
        lambda v: v is None or v >= 2,
    )  # fmt: skip
    class_names: tuple[str, ...] | None = setting(
        None, "null or a list of names, one per class", lambda v: v is None or len(v) >= 2
    )
    # Where the dataset is and how to reach it, as ``asyncload load`` takes them: a JSON file of Deep
    # Lake creds (aws_access_key_id, aws_secret_access_key, endpoint_url...), an S3 endpoint, an AWS
    # profile, an Activeloop token. Without them, the standard AWS chain.
    creds: str | None = None
    endpoint: str | None = None
    profile: str | None = None
    token: str | None = None
    rows: int = setting(1200, "an int >= 0 (rows used, and made when missing; 0: all rows)", lambda v: v >= 0)
    image_size: int = setting(
        64, "an int >= 8 (height and width of made images, and of validation images, resized to it)", lambda v: v >= 8
    )
    # The data made when missing: ``make_sizes: null``, clean image_size x image_size rows; ``[lo, hi]``,
    # photo-like rows of many sizes (asyncload.tools.synthetic.make_dataset's ``sizes``, ``aspect``, formats).
    make_sizes: tuple[int, int] | None = setting(
        None, "null or [min, max] with 8 <= min <= max (long side of made photos)", lambda v: v is None or _span(7)(v)
    )
    make_aspect: tuple[float, float] = setting(
        (0.6, 1.7), "[min, max] with 0 < min <= max (width / height of made photos)", _span(0.0)
    )
    make_format: Literal["png", "jpg"] = "png"  # made images
    make_mask_format: Literal["lz4", "png"] = "lz4"  # made masks
    # Training augmentation, one draw per sample applied alike to image and mask; validation images are
    # only resized to image_size.
    crop: int | None = setting(
        None,
        "null or an int >= 8 (side of random resized crops; null: resize to image_size)",
        lambda v: v is None or v >= 8,
    )
    crop_scale: tuple[float, float] = setting(
        (0.25, 1.0), "[min, max] with 0 < min <= max <= 1 (crop area, a fraction of the image's)", _span(0.0, 1.0)
    )
    crop_ratio: tuple[float, float] = setting(
        (0.75, 1.333), "[min, max] with 0 < min <= max (crop width / height)", _span(0.0)
    )
    flip: float = setting(0.0, "a number in [0, 1] (probability of a horizontal flip)", lambda v: 0 <= v <= 1)
    batch_size: int = setting(32, "an int >= 1", lambda v: v >= 1)
    epochs: int = setting(4, "an int >= 1", lambda v: v >= 1)
    lr: float = setting(3e-3, "a number > 0", lambda v: v > 0)
    width: int = setting(16, "an int >= 1 (channels of the first U-Net level; then 2x and 4x)", lambda v: v >= 1)
    loader: Literal["asyncload", "sync"] = "asyncload"
    concurrency: int = setting(64, "an int >= 1", lambda v: v >= 1)
    prefetch: int = setting(4, "an int >= 1", lambda v: v >= 1)
    num_workers: int = setting(0, "an int >= 0 (DataLoader worker processes)", lambda v: v >= 0)
    processes: int = setting(
        0, "an int >= 0 (AsyncLoader worker processes of the training split; 0: read in this process)", lambda v: v >= 0
    )
    depth: int = setting(2, "an int >= 0 (batches copied to the device ahead)", lambda v: v >= 0)
    # How asyncload decodes (its ``decode`` setting; "cuda": nvJPEG and the masks on the GPU) and whether it
    # delivers model-ready images (normalized as ``UNet.prepare``, NCHW, bf16 under bf16 autocast on CUDA,
    # else float32), so that the step only feeds them to the model. Both apply to ``loader: asyncload``.
    decode: str = setting(
        "auto",
        "'auto', 'cpu', 'store', 'cuda' or 'cuda:N'",
        lambda v: v in ("auto", "cpu", "store", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()),
    )
    model_ready: bool = False
    bf16: bool = True  # bf16 autocast on CUDA (ignored on the CPU)
    channels_last: bool = True  # channels_last activations and weights on CUDA (ignored on the CPU)
    cudnn_benchmark: bool = True  # let cuDNN pick the fastest kernels for the (fixed) shapes, on CUDA
    model_only_steps: int = setting(
        20, "an int >= 0 (timed steps on one batch already on the device after training; 0: skip)", lambda v: v >= 0
    )
    holdout: float = setting(
        0.2, "a number > 0 and < 1 (fraction of rows held out for validation)", lambda v: 0 < v < 1
    )
    seed: int = 0
    device: str = setting("auto", "'auto', 'cpu', 'cuda' or 'cuda:N'", _device_ok)
    threads: int = setting(0, "an int >= 0 (torch CPU threads; 0: torch's default)", lambda v: v >= 0)
    checkpoint: str | None = "checkpoints/unet.pt"
    resume: bool = True  # continue from ``checkpoint`` when it exists
    checkpoint_every: int = setting(
        0, "an int >= 0 (steps between mid-epoch checkpoints; 0: epoch ends only)", lambda v: v >= 0
    )
    max_steps_per_epoch: int = setting(0, "an int >= 0 (0: whole epochs)", lambda v: v >= 0)
    index_log: str | None = None  # a folder: each rank appends the dataset indices it trained on per epoch
    progress: bool = True  # tqdm bar on rank 0

    def __post_init__(self) -> None:
        validate(self)
        check(
            "class_names", self.class_names,
            self.class_names is None or self.classes is None or len(self.class_names) == self.classes,
            f"a list of {self.classes} names (classes: {self.classes})",
        )  # fmt: skip
        check(
            "processes", self.processes, not self.processes or (self.loader == "asyncload" and not self.num_workers),
            "0 with loader: sync or num_workers > 0 (processes are AsyncLoader's own workers, used instead of "
            "DataLoader's)",
        )  # fmt: skip
