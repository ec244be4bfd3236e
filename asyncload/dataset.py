"""``AsyncIterableDataset``: the loader as a ``torch.utils.data.IterableDataset``.

Use it with ``DataLoader(ds, batch_size=None, num_workers=N)``: the dataset already yields batches.

Why it is exact across workers and ranks: each DataLoader worker builds its own ``AsyncLoader`` in its
own process (the loop starts there, after any fork) over its own share of the epoch (see ``sampler``):
rank from ``torch.distributed`` when a process group is initialised, worker from
``get_worker_info()``. Batch ``k`` of a rank goes to worker ``k % num_workers``, and DataLoader reads
workers round-robin, so a rank sees the same batch sequence with 0, 1 or 8 workers.

A spawned worker has no process group: the rank is pinned when DataLoader pickles the dataset in the
rank's main process. The source is pickled as a description (URL, columns, credentials); each worker opens the store itself.
Call ``set_epoch(e)`` before each epoch, as with ``DistributedSampler``: the copy in each worker is made
when DataLoader starts iterating, so the epoch must be set on this object before that.

Resume: the batches a DataLoader yielded are only seen by the training loop, which counts its steps
anyway. ``state_dict(batches_consumed=k)`` records the epoch and that count; after
``load_state_dict``, the rank's remaining batches are dealt to the workers from worker 0 again, so the
resumed DataLoader yields exactly the batches the interrupted one had not, in the same order (with
DataLoader's default ``in_order=True``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.data

from .loader import AsyncLoader, EpochIterator
from .sampler import EpochSampler, Remainder, Shard
from .sources.base import Source


def _distributed_rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class AsyncIterableDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches of ``source`` for ``DataLoader(..., batch_size=None)``; options as ``AsyncLoader``.

    ``rank``/``world_size`` default to the initialised ``torch.distributed`` process group (or 0/1).
    ``remainder`` ("pad" or "drop") says what happens when ranks do not divide the dataset, so that every
    rank yields the same number of batches.
    """

    def __init__(
        self,
        source: Source[Any],
        batch_size: int = 32,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        remainder: Remainder = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        **loader_options: Any,
    ) -> None:
        super().__init__()
        self.source = source
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.remainder: Remainder = remainder
        self.rank = rank
        self.world_size = world_size
        self.loader_options = loader_options
        self.epoch = 0
        self._start = 0  # rank batches of ``epoch`` already consumed (resume)
        # Validate every option now, in the constructing process, so mistakes surface before workers start.
        AsyncLoader(source, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last, remainder=remainder, **loader_options)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch that the next iteration yields (call before creating the DataLoader iterator).
        A resume point survives only ``set_epoch`` of its own epoch."""
        if epoch != self.epoch:
            self._start = 0
        self.epoch = epoch

    def state_dict(self, batches_consumed: int) -> dict[str, Any]:
        """The resume point after this rank's training loop took ``batches_consumed`` batches of the
        current epoch (counted from the epoch's start, including those before an earlier resume)."""
        total = self._rank_batches()
        if not 0 <= batches_consumed <= total:
            raise ValueError(f"batches_consumed={batches_consumed} is not allowed: 0..{total} (batches in this rank's epoch)")
        return {"version": 1, "epoch": self.epoch, "batches_consumed": batches_consumed, "rank_batches": total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue ``state``'s epoch after the batches it had consumed (next DataLoader iterator)."""
        total = self._rank_batches()
        if state.get("rank_batches") != total:
            raise ValueError(
                f"state has rank_batches={state.get('rank_batches')!r}, this dataset {total}: it was saved "
                f"with other options, dataset length or world size"
            )
        self.epoch = int(state["epoch"])
        self._start = int(state["batches_consumed"])

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader pickles the dataset in the main process for spawn/forkserver workers, where no
        # process group exists: pin this rank's place in the world now. (Forked workers inherit it.)
        state = self.__dict__.copy()
        rank, world = _distributed_rank_world()
        if state["rank"] is None:
            state["rank"] = rank
        if state["world_size"] is None:
            state["world_size"] = world
        return state

    def shard(self) -> Shard:
        """The share of the epoch this process serves: rank × DataLoader worker."""
        rank, world = _distributed_rank_world()
        rank = self.rank if self.rank is not None else rank
        world = self.world_size if self.world_size is not None else world
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return Shard(rank=rank, world_size=world, worker=worker, num_workers=workers)

    def _sampler(self, shard: Shard) -> EpochSampler:
        return EpochSampler(
            len(self.source), self.batch_size, shuffle=self.shuffle, seed=self.seed,
            drop_last=self.drop_last, remainder=self.remainder, shard=shard,
        )  # fmt: skip

    def _rank_batches(self) -> int:
        s = self.shard()
        return self._sampler(Shard(s.rank, s.world_size)).rank_batches

    def __len__(self) -> int:
        """Batches this rank yields in the next iteration, summed over its DataLoader workers (the
        whole epoch, or its rest after ``load_state_dict``)."""
        return self._rank_batches() - self._start

    def __iter__(self) -> EpochIterator:
        loader = AsyncLoader(
            self.source, self.batch_size, shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last,
            remainder=self.remainder, shard=self.shard(), start_batch=self._start, **self.loader_options,
        )  # fmt: skip
        loader.set_epoch(self.epoch)
        return iter(loader)
