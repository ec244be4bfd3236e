"""What a world of ranks has consumed of an epoch, as positions of the epoch's global order: the part of a
resume state that does not depend on how many ranks, workers or batches read it.

Why positions of the global order: the order of an epoch is a pure function of the seed and the epoch
(``sampler.EpochSampler.order``), the same in every process of any world. A world cuts it into contiguous
rank shares and each share into batches; what a rank consumed is a prefix of its share (plus a few later
batches when batches are taken out of order). Named as positions of the order, what was consumed by 2 ranks
means the same thing to 3: the new world leaves those positions out and cuts the rest among its own ranks
(``EpochSampler.taken``), so every row of the epoch comes once across the old and new runs (a pad of at most
``world_size - 1`` repeats where the new world does not divide what is left, with ``remainder="pad"``).

What the state stores is small and needs no knowledge of the other ranks: the cut the saver's world made
(world size, batch size, remainder, drop_last, start, and the positions an earlier run had taken, as ranges)
and the saver's consumed batches (``EpochProgress``: a prefix and a few extras). The positions are worked out
when the state is loaded (``consumed``). That a state from one rank describes every rank rests on what
``DistributedDataParallel`` guarantees anyway: every rank takes the same number of batches per step, so when
rank 0 saves after ``k`` batches, every rank has consumed its first ``k``. A state saved by a DataLoader
worker's loader (a share of a rank) knows only its own batches, so it resumes only that share.

What a checkpoint must hold: one state, from any rank (rank 0), saved after the step that took the last
batch it counts (``DeviceFeed.state_dict()`` where a feed holds batches ahead). What it promises: the
rows of that epoch not yet taken by any rank, each once, whatever the new world size, batch size or
number of DataLoader workers; the same seed, shuffle settings and data are required (a changed version
of the data is refused). Resuming on fewer GPUs with ``torchrun``::

    # train.py, under torchrun --nproc-per-node 8 (and later --nproc-per-node 4)
    loader = AsyncLoader(src, batch_size=32, shuffle=True, seed=0)  # the rank from the process group
    if os.path.exists("ckpt.pt"):
        ckpt = torch.load("ckpt.pt")
        model.load_state_dict(ckpt["model"])
        loader.load_state_dict(ckpt["data"])  # every rank loads the one state rank 0 saved
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)  # keeps a loaded resume point of that epoch
        for step, batch in enumerate(loader):
            train_step(batch)
            if step % 500 == 0 and dist.get_rank() == 0:
                torch.save({"model": model.state_dict(), "data": loader.state_dict()}, "ckpt.pt")
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import ConfigError
from .progress import EpochProgress
from .sampler import EpochSampler, Ranges, Shard


def merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """``ranges`` sorted, with overlapping and touching ones joined, empty ones dropped."""
    out: list[tuple[int, int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def free(n: int, taken: Ranges) -> Ranges:
    """The positions of ``range(n)`` not in ``taken``, as ranges."""
    out, at = [], 0
    for a, b in taken:
        if a > at:
            out.append((at, a))
        at = b
    if at < n:
        out.append((at, n))
    return tuple(out)


def _slice(runs: Ranges, starts: list[int], lo: int, hi: int) -> list[tuple[int, int]]:
    """Items ``[lo, hi)`` of the list the ``runs`` spell out one after the other, as ranges of their values
    (``starts``: each run's first item)."""
    out = []
    k = max(0, bisect.bisect_right(starts, lo) - 1)
    while k < len(runs) and starts[k] < hi:
        a, b = runs[k]
        first, last = max(lo, starts[k]), min(hi, starts[k] + b - a)
        if last > first:
            out.append((a + first - starts[k], a + last - starts[k]))
        k += 1
    return out


def consumed(sampler: EpochSampler, progress: EpochProgress) -> Ranges:
    """The positions of the epoch's order consumed by the world ``sampler`` was cut for, when every rank of
    it has consumed the batches ``progress`` records for ``sampler``'s shard (see the module doc), with the
    positions ``sampler.taken`` by the runs before. Pads (repeats) count as nothing: their rows are the
    epoch's first, consumed or left in their own places."""
    if sampler.shard.num_workers != 1:
        raise ValueError("a DataLoader worker's share knows only its own batches, not its rank's")
    left = free(sampler.n, sampler.taken)
    starts, at = [], 0
    for a, b in left:
        starts.append(at)
        at += b - a
    real = at  # positions of the remaining list before the pad
    per, size, start = sampler.rank_samples, sampler.batch_size, sampler.start
    # The rank's batches consumed: the first ``start`` (left out by this run), then the progress's.
    spans = [(0, start + progress.next), *((start + j, start + j + 1) for j in sorted(progress.extra))]
    got: list[tuple[int, int]] = list(sampler.taken)
    for rank in range(sampler.shard.world_size):
        for first, last in spans:
            lo, hi = rank * per + first * size, rank * per + min(last * size, per)
            got.extend(_slice(left, starts, lo, min(hi, real)))
    return merge(got)


def order_of(s: EpochSampler, dataset: dict[str, Any]) -> dict[str, Any]:
    """What fixes the epoch's global order, as a state saves it: it must match for a state to resume.
    ``dataset``: what names the data (``progress.dataset_of``: URL, identity, version)."""
    return {
        "n": s.n, "shuffle": s.shuffle, "seed": s.seed,
        "shuffle_block": s.block if s.shuffle else None, "shuffle_window": s.window if s.shuffle else None,
        **dataset,
    }  # fmt: skip


def cut_of(s: EpochSampler) -> dict[str, Any]:
    """How ``s`` cuts the epoch's order, as a state saves it (plain lists and numbers); ``nodes`` where the
    order was made for several (``engine.nodes``), so that a world on another number resumes the rest of
    the epoch in the saver's order."""
    cut = {
        "batch_size": s.batch_size, "drop_last": s.drop_last, "remainder": s.remainder, "start": s.start,
        "shard": [s.shard.rank, s.shard.world_size, s.shard.worker, s.shard.num_workers],
        "taken": [[a, b] for a, b in s.taken],
    }  # fmt: skip
    return cut | {"nodes": s.nodes} if s.nodes != 1 else cut


def resume_cut(base: EpochSampler, progress: EpochProgress, cut: dict[str, Any]) -> tuple[EpochProgress, EpochSampler]:
    """What a loader whose fresh epochs are cut as ``base`` resumes from ``progress`` saved in ``cut``: the
    progress and the cut of the rest of the epoch. The same cut (the same shard of the same world, the same
    batches, the same positions taken before) resumes batch for batch; any other, from the positions the
    saver's world consumed, the rest cut as ``base`` cuts (its world, its batch size)."""
    try:
        taken = merge(tuple(map(tuple, cut.get("taken") or ())))
        same = dataclasses.replace(base, taken=taken)
        if cut == cut_of(same):
            if progress.total != len(same):
                raise ConfigError(
                    f"state has {progress.total} batches in epoch {progress.epoch}, this loader {len(same)}"
                )
            return progress, same
        saved = dataclasses.replace(
            same, batch_size=int(cut["batch_size"]), drop_last=bool(cut["drop_last"]), remainder=cut["remainder"],
            start=int(cut["start"]), shard=Shard(*map(int, cut["shard"])), nodes=int(cut.get("nodes", 1)),
        )  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"state's cut {cut!r} is not allowed ({type(exc).__name__}: {exc})") from None
    if saved.shard.num_workers != 1:
        raise ConfigError(
            f"state was saved with shard={cut['shard']} (a DataLoader worker's share, which knows only its own "
            f"batches), but this loader has shard={cut_of(base)['shard']}: load it into that worker's share, or "
            f"save the rank's state (AsyncIterableDataset.state_dict(batches_consumed=k))"
        )
    if progress.total != len(saved):
        raise ConfigError(f"state has {progress.total} batches in epoch {progress.epoch}, its cut {len(saved)}")
    taken = consumed(saved, progress)
    if (saved.nodes > 1 or base.nodes > 1) and not np.array_equal(
        mine := base.order(progress.epoch), saved.order(progress.epoch)
    ):  # the saver's order was another world's (``engine.nodes``): the rows it consumed, where this one has them
        rows = saved.order(progress.epoch)[np.concatenate([np.arange(a, b) for a, b in taken] or [np.empty(0, int)])]
        here = np.flatnonzero(np.isin(mine, rows))
        breaks = np.flatnonzero(np.diff(here) != 1) + 1
        taken = tuple((int(r[0]), int(r[-1]) + 1) for r in np.split(here, breaks) if len(r))
    rest = dataclasses.replace(base, taken=taken)
    return EpochProgress(progress.epoch, len(rest)), rest


__all__ = ["consumed", "cut_of", "free", "merge", "order_of", "resume_cut"]
