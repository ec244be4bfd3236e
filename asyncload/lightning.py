"""PyTorch Lightning: keep ``AsyncIterableDataset`` epochs in step with the ``Trainer``.

Why a callback is needed: Lightning calls ``set_epoch`` only on a DataLoader's *sampler*, and an
``IterableDataset`` has none that it owns, so without help every epoch would repeat epoch 0's order
(with persistent workers and without). And a mid-epoch checkpoint records Lightning's step count, not
where the data stood, so a resumed run would start the epoch's data from its beginning.

``AsyncLoadCallback(train_ds)`` does both:
- before every training epoch, ``set_epoch(trainer.current_epoch)`` (this reaches persistent DataLoader
  workers: the epoch lives in shared memory);
- it saves, in each checkpoint, the epoch and the batches Lightning had trained of it, and on resume it
  puts the dataset there *before* Lightning creates its first iterator (``on_fit_start``), so the
  resumed epoch yields exactly the batches Lightning has not trained, in order;
- with ``log_stats_every_n_steps=N``, every N training steps it logs where the data time goes
  (``statslog.scalars`` of ``dataset.stats()``: per-stage seconds, the wait fraction, ``waiting_on``) through
  the trainer's logger. The training loop's own wait for data (the time from one batch's end to the
  next one's start) and its steps (start to end) are measured here and replace the DataLoader workers'
  in the verdict.

Usage::

    from asyncload.lightning import AsyncLoadCallback

    ds = AsyncIterableDataset(DeepLakeSource(url), batch_size=32, shuffle=True)
    dl = DataLoader(ds, batch_size=None, num_workers=4, persistent_workers=True)
    Trainer(max_epochs=10, callbacks=[AsyncLoadCallback(ds)]).fit(model, dl)

Needs the ``lightning`` package (``pip install 'torch-asyncload[lightning]'``).
"""

from __future__ import annotations

import time
from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as exc:  # pragma: no cover - depends on what is installed
    raise ImportError("asyncload.lightning needs PyTorch Lightning: pip install 'torch-asyncload[lightning]'") from exc

from .dataset import AsyncIterableDataset
from .engine.statslog import scalars
from .errors import ConfigError

STATE_VERSION = 1


class AsyncLoadCallback(pl.Callback):
    """Sets the epoch of ``datasets`` at each training epoch and records their position in checkpoints."""

    def __init__(self, *datasets: AsyncIterableDataset, log_stats_every_n_steps: int | None = None) -> None:
        if not datasets or not all(isinstance(d, AsyncIterableDataset) for d in datasets):
            raise ConfigError(
                f"datasets={datasets!r} is not allowed: pass the AsyncIterableDataset(s) of the training DataLoader(s)"
            )
        n = log_stats_every_n_steps
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ConfigError(f"log_stats_every_n_steps={n!r} is not allowed: an int >= 1, or None (off)")
        self.datasets = datasets
        self.log_stats_every_n_steps = n
        self._wait_s = 0.0  # this epoch: the training loop waiting for data, after its first batch
        self._step_s = 0.0  # ... in training steps
        self._started: float | None = None  # the step in progress began
        self._ended: float | None = None  # the last step ended (None at an epoch's start)
        self._trainer: pl.Trainer | None = None
        self._loaded: dict[str, Any] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    # -- where the data stands, in Lightning's terms -------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The epoch and how many of its batches Lightning has trained. A checkpoint written at the end
        of a training step counts that step (Lightning resumes after it); a finished epoch is saved as
        the start of the next."""
        trainer = self._trainer
        if trainer is None:
            return {}
        epoch = trainer.current_epoch
        done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        total = trainer.num_training_batches
        if isinstance(total, int) and done >= total:
            epoch, done = epoch + 1, 0
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "batches": done,
            "datasets": [d.state_dict(batches_consumed=0) for d in self.datasets],  # versions, lengths
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = dict(state_dict) if state_dict else None

    # -- applying it -----------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Runs after callbacks are restored and before the fit loop makes its first DataLoader iterator.
        state, self._loaded = self._loaded, None
        if state is None:
            self._set_epoch(trainer.current_epoch)
            return
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"AsyncLoadCallback state version {state.get('version')!r} is not allowed: {STATE_VERSION}"
            )
        for ds, saved in zip(self.datasets, state["datasets"], strict=True):
            ds.load_state_dict({**saved, "epoch": state["epoch"], "batches_consumed": state["batches"]})

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # For every epoch after the first, Lightning creates the epoch's iterator after this hook. A
        # resumed epoch keeps its position: set_epoch of the same epoch does not clear it.
        self._set_epoch(trainer.current_epoch)
        self._wait_s = self._step_s = 0.0
        self._started = self._ended = None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Every rank posts its epoch's figures; rank 0 names the slowest rank in stats() and the log.
        timed = self.log_stats_every_n_steps is not None  # the loop's own wait and steps, where measured
        for ds in self.datasets:
            ds.report_ranks(self._wait_s if timed else None, self._step_s if timed else None)
        if trainer.logger is not None and trainer.global_rank == 0 and self.log_stats_every_n_steps is not None:
            trainer.logger.log_metrics(self.figures(), step=trainer.global_step)

    # -- where the data time goes (log_stats_every_n_steps) -----------------------------------------
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.log_stats_every_n_steps is None:
            return
        self._started = now = time.perf_counter()
        if self._ended is not None:
            self._wait_s += now - self._ended

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.log_stats_every_n_steps
        if n is None or self._started is None:
            return
        self._ended = now = time.perf_counter()
        self._step_s += now - self._started
        if (batch_idx + 1) % n == 0 and trainer.logger is not None:
            trainer.logger.log_metrics(self.figures(), step=trainer.global_step)

    def figures(self) -> dict[str, float]:
        """What ``log_stats_every_n_steps`` logs: ``scalars`` of each dataset's ``stats()``, with the
        training loop's wait and steps as measured here (``asyncload/...``; ``asyncload<k>/...`` for the
        k-th dataset after the first)."""
        out: dict[str, float] = {}
        for k, ds in enumerate(self.datasets):
            stats = ds.stats(wait_s=self._wait_s, step_s=self._step_s)
            out.update(scalars(stats, "asyncload" if k == 0 else f"asyncload{k}"))
        return out

    def _set_epoch(self, epoch: int) -> None:
        for ds in self.datasets:
            ds.set_epoch(epoch)


__all__ = ["AsyncLoadCallback"]
