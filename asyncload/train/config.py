"""``TrainConfig``: the training job's settings, validated before anything starts (``configs/train_unet.yaml``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config import check, setting, validate


def _device_ok(v: str) -> bool:
    return v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit())


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; ``configs/train_unet.yaml`` holds the defaults below."""

    data: str = setting("data/synthetic-seg-64", "a non-empty path or URL of a Deep Lake dataset", lambda v: bool(v))
    make_data: bool = True  # write the synthetic dataset at ``data`` when nothing is there
    rows: int = setting(1200, "an int >= 0 (rows used, and made when missing; 0: all rows)", lambda v: v >= 0)
    image_size: int = setting(64, "an int >= 8 (height and width of made images)", lambda v: v >= 8)
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
