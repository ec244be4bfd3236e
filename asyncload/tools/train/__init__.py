"""Train a compact U-Net on the synthetic segmentation data, fed by asyncload or by the synchronous baseline.

    python -m asyncload.train --config configs/train_unet.yaml [--set key=value ...]
    torchrun --nproc_per_node=2 -m asyncload.train --config configs/train_unet.yaml

What it is for: the end-to-end check that the loader feeds a real training loop, and the figure that
matters to a user, the fraction of step time spent waiting for data, measured the same way for
``loader: asyncload`` and for ``loader: sync`` (a map-style ``Dataset`` reading ``ds[i]["images"]``,
``ds[i]["masks"]`` through ``DataLoader``).

Choices, and why:
- **Validation split by index range**: train on rows ``[0, n_train)``, evaluate on ``[n_train, n)``. The
  loader has no subset option, so ``RangeSource`` (a thin ``Source`` over a row range of another source)
  gives each split its own, exact epoch; the sampler then shards only that range across ranks and
  workers. No second dataset is written and nothing is filtered after reading.
- **Images of many sizes** reach the model at one size: training reads a random resized crop of each
  image (``crop``, ``crop_scale``, ``crop_ratio``), mirrored with probability ``flip``; validation the
  whole image resized to ``image_size``, the same pixels every epoch. asyncload draws the geometry from
  (seed, epoch, row) and applies it to image and mask alike in its decode stage; ``loader: sync`` applies
  the same draws per sample in torch, so both train on the same crops. On data stored at ``image_size``
  the resize leaves the stored pixels as they are.
- **Scale-out** follows torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``): a process group (gloo on CPU, nccl on CUDA) and
  ``DistributedDataParallel``. ``AsyncIterableDataset`` reads the rank from the process group, and every
  rank gets the same number of batches, which is what keeps DDP's all-reduces in step. Only rank 0 logs
  and writes checkpoints; losses, IoU counts and timings are all-reduced.
- **Worker processes**: ``processes: K`` reads the training split with ``AsyncLoader(processes=K)``, K
  persistent spawn workers started by the first epoch and kept to the end of the job (instead of
  ``num_workers`` DataLoader workers; the held-out split is read in the training process). Its resume
  state counts the steps trained (``data.TrainedPrefix``): ``DeviceFeed`` takes batches ahead of them.
- **Evaluation counts each held-out row once**: ranks pad their shares to equal length, so the padded
  repeats at the end of a rank's share are masked out of the IoU counts.
- **Checkpoints** hold model, optimizer, epoch, global step and the step within the epoch (plus the
  loader's ``state_dict()`` when it offers one). They are written atomically (temp file + rename) so an
  interrupted save never leaves a broken file. A mid-epoch resume restores the loader state when the
  loader can take it back; otherwise it replays the epoch's deterministic order and skips the batches
  already trained (read, not trained).
- **GPU practice, on by default on CUDA**: bf16 autocast (no loss scaling needed, unlike fp16),
  channels_last tensors (the layout cuDNN's fastest convolution kernels use on tensor cores) and
  ``cudnn.benchmark`` (the U-Net's shapes are fixed, so the one-off kernel search pays); the H100
  figures are in ``benchmarks/results/design_notes.md``. Each has an off switch in the config; on the CPU they are left off (bf16 convolutions are slow on most CPUs).
- **A truthful data-wait figure**: only the time the loop is blocked in ``next()`` for its next batch
  counts as waiting for data. The device runs asynchronously, so the host also waits for it, at known
  points only (the loss read back every ``SYNC_EVERY`` steps and at the end of the epoch), and that time
  is reported apart as "device sync". The old figure (time inside ``DeviceFeed``, which then copied on
  this thread) put the host's wait for the GPU under data wait, where the model was the bottleneck.
- **The model-only rate, measured the same way**: after training, the same step function runs
  ``model_only_steps`` times on one batch already on the device (model and optimizer put back after),
  so "trains at X% of the model-only rate" compares like with like.

Modules: ``config`` (TrainConfig), ``data`` (splits, the synchronous baseline), ``model`` (UNet), ``world``
(process group, devices), ``steps`` (the timed step loop), ``job`` (the run, evaluation, checkpoints, CLI).
"""

from __future__ import annotations

import importlib
from typing import Any

#: Public names → their module. Imported on first use: ``asyncload train`` reads and checks its config
#: (``train.config``, no torch) before the job and torch are imported, so a wrong config answers at once.
_WHERE = {
    "RangeSource": "asyncload.sources.subset",
    "StepOptions": ".steps",
    "StepTimes": ".steps",
    "TrainConfig": ".config",
    "UNet": ".model",
    "config_from_args": ".job",
    "cuda_index_for_rank": ".world",
    "main": ".job",
    "model_only_rate": ".steps",
    "sync": ".steps",
    "timed_steps": ".steps",
    "train": ".job",
    "train_step": ".steps",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_WHERE)
