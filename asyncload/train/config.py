"""``TrainConfig``: the training job's settings, validated before anything starts (``configs/train_unet.yaml``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..config import check, setting, validate


def _device_ok(v: str) -> bool:
    return v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())


def _span(low: float, high: float | None = None) -> Callable[[tuple[float, float]], bool]:
    """A rule for a ``[min, max]`` pair: ``low < min <= max`` (and ``max <= high`` when given)."""
    return lambda v: low < v[0] <= v[1] and (high is None or v[1] <= high)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; ``configs/train_unet.yaml`` holds the defaults below."""

    data: str = setting("data/synthetic-seg-64", "a non-empty path or URL of a Deep Lake dataset", lambda v: bool(v))
    make_data: bool = True  # write the synthetic dataset at ``data`` when nothing is there
    rows: int = setting(1200, "an int >= 0 (rows used, and made when missing; 0: all rows)", lambda v: v >= 0)
    image_size: int = setting(
        64, "an int >= 8 (height and width of made images, and of validation images, resized to it)", lambda v: v >= 8
    )
    # The data made when missing: ``make_sizes: null``, clean image_size x image_size rows; ``[lo, hi]``,
    # photo-like rows of many sizes (asyncload.synthetic.make_dataset's ``sizes``, ``aspect``, formats).
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
            "processes", self.processes, not self.processes or (self.loader == "asyncload" and not self.num_workers),
            "0 with loader: sync or num_workers > 0 (processes are AsyncLoader's own workers, used instead of "
            "DataLoader's)",
        )  # fmt: skip
