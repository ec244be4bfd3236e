"""A real Lightning ``Trainer`` on CPU, fed by ``AsyncIterableDataset`` in persistent DataLoader workers:
a new order each epoch, each sample once, and exact resume from a checkpoint mid-epoch and at an
epoch's end.

The workers start by forkserver (conftest.WORKER_START), not fork: forked ones inherit the Deep Lake
runtime of a parent that has opened (and, through the session fixture, written) datasets, and segfaulted
in about 1 of 6 runs here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, ConfigError, DeepLakeSource

from .conftest import ROWS, WORKER_START, shuffled

pl = pytest.importorskip("lightning.pytorch")
from asyncload.lightning import AsyncLoadCallback  # noqa: E402

pytestmark = pytest.mark.timeout(240)

BATCH = 16
PLAN = shuffled(ROWS, BATCH, 4)


class Interrupted(Exception):
    """Stands for a crash right after a checkpoint was written."""


class Recorder(pl.LightningModule):
    """Records the dataset indices of every batch it trains, per epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[int, list[list[int]]] = {}

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        epoch = self.seen.setdefault(self.current_epoch, [])
        assert batch_idx == len(epoch) + (self.first_idx if self.current_epoch == self.resumed_epoch else 0)
        epoch.append(batch["index"].tolist())
        return self.layer(batch["images"].float().mean().reshape(1, 1)).sum()

    first_idx = 0
    resumed_epoch = -1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class CheckpointThenCrash(pl.Callback):
    """Writes a checkpoint at the end of batch ``batch`` of ``epoch`` (or at the epoch's end), then stops
    the run with an exception, as a preempted job would."""

    def __init__(self, path: Path, epoch: int, batch: int | None) -> None:
        self.path, self.epoch, self.batch = path, epoch, batch

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            trainer.save_checkpoint(self.path)
            raise Interrupted

    def on_train_epoch_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        if trainer.current_epoch == self.epoch and self.batch is None:
            trainer.save_checkpoint(self.path)
            raise Interrupted


def run(
    url: str, root: Path, *extra: pl.Callback, ckpt: Path | None = None, module: Recorder | None = None
) -> Recorder:
    ds = AsyncIterableDataset(DeepLakeSource(url), batch_size=BATCH, shuffle=True, seed=4, concurrency=16)
    dl = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context=WORKER_START)
    module = module or Recorder()
    trainer = pl.Trainer(
        max_epochs=3, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
        callbacks=[AsyncLoadCallback(ds), *extra],
    )  # fmt: skip
    trainer.fit(module, dl, ckpt_path=ckpt)
    return module


def test_each_epoch_has_its_own_order_and_every_sample_once(seg_url: str, tmp_path: Path) -> None:
    seen = run(seg_url, tmp_path).seen
    assert sorted(seen) == [0, 1, 2]
    for e in range(3):
        assert seen[e] == PLAN.batches(e), f"epoch {e}"
        assert sorted(i for b in seen[e] for i in b) == list(range(ROWS))
    assert seen[0] != seen[1] != seen[2]


@pytest.mark.parametrize(("epoch", "batch"), [(1, 4), (0, None)], ids=["mid-epoch", "epoch-end"])
def test_resume_from_a_checkpoint_is_exact(seg_url: str, tmp_path: Path, epoch: int, batch: int | None) -> None:
    ckpt = tmp_path / "step.ckpt"
    first = Recorder()
    with pytest.raises(Interrupted):
        run(seg_url, tmp_path, CheckpointThenCrash(ckpt, epoch, batch), module=first)
    second = Recorder()
    if batch is not None:
        second.first_idx, second.resumed_epoch = batch + 1, epoch
    second = run(seg_url, tmp_path, ckpt=ckpt, module=second)
    for e in range(3):
        got = first.seen.get(e, []) + second.seen.get(e, [])
        assert got == PLAN.batches(e), f"epoch {e}: before the crash {len(first.seen.get(e, []))} batches"


def test_the_callback_needs_the_datasets() -> None:
    with pytest.raises(ConfigError, match="pass the AsyncIterableDataset"):
        AsyncLoadCallback()
