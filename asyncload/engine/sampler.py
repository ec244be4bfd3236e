"""Which indices, in what order: seeded shuffling, rank × worker sharding, equal batches per rank.

The plan for an epoch is a pure function of ``(n, batch_size, shuffle, seed, epoch, drop_last,
remainder, shard)``. No state is shared between processes: every rank and every DataLoader worker
computes the same global order and keeps its own share, which is what makes epochs exact without any
coordination.

How an epoch is cut:
1. a global order of ``range(n)``: identity, or a permutation seeded by ``(seed, epoch)``. A shuffled
   order is read in *blocks* (``block``: rows ``[k*block, (k+1)*block)``, contiguous in the store): the
   blocks come in a random order and each block's rows are spread at random over a ``window`` of
   positions (``block_order``), so every row comes once and each batch mixes ``window / block`` blocks.
   Stores lay rows out in order and read far more than a row per request (Deep Lake pulls ~130-260 KB
   for a 20 KB row), so a row read with its block costs its own bytes, and one read alone its range's
   (``blocks.BlockReads`` reads each row once, with its block). ``block=1`` is a full shuffle;
2. ranks get equal, contiguous blocks of it (contiguous keeps neighbouring rows, which share storage
   chunks, in one rank). When ``world_size`` does not divide ``n`` the ``remainder`` policy decides:
   ``"pad"`` repeats the first samples of the order so every sample is seen at least once,
   ``"drop"`` leaves the last ones out of this epoch (a different few each shuffled epoch);
3. a rank's block is cut into batches (the last one short unless ``drop_last``), so every rank has the
   same number of batches, which is what collective ops in DistributedDataParallel need;
4. DataLoader workers of a rank take its batches round-robin (batch ``k`` to worker ``k % W``). PyTorch's
   DataLoader reads its workers round-robin too, so the rank's batch sequence comes out unchanged and
   the batches are the same whatever the number of workers.
5. ``start`` resumes a rank mid-epoch: its first ``start`` batches are left out and the rest are dealt
   to workers from worker 0 again (batch ``k`` to worker ``(k - start) % W``), because a new DataLoader
   iterator also starts its round-robin at worker 0.
6. ``taken`` resumes the *world* mid-epoch, whatever its size was (``engine.consumed``): the positions of
   the global order that an earlier run consumed are left out and what remains, in order, is cut among
   this world's ranks as in 2-4. A pad repeats the first positions of the epoch's order, as in 2, so a
   resume into the world that saved reproduces the uninterrupted run batch for batch.

A source that composes its own epochs (``MixedSource``: rows of several sources in fixed proportions,
each cycling through its rows across epochs) gives its global order through ``EpochOrder``: the sampler
then cuts that order instead of a permutation of ``range(n)``, so the mixture's interleave (and with it
each batch's proportion) survives ranks, workers and resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from .nodes import node_parts

Remainder = Literal["pad", "drop"]

#: Positions of an epoch's global order, as sorted, disjoint, half-open ranges ``(start, stop)``.
Ranges = tuple[tuple[int, int], ...]


@runtime_checkable
class EpochOrder(Protocol):
    """An epoch's global order composed by its source (``engine.mixing.MixedOrder``), not a permutation of
    ``range(n)``: ``n`` distinct positions of the source, which may have more positions than ``n``. A pure
    function of its arguments, so that every rank and worker computes the same order."""

    def order(self, seed: int, epoch: int, shuffle: bool, block: int, window: int) -> np.ndarray: ...


@dataclass(frozen=True)
class Shard:
    """The share of an epoch one iterator serves: a distributed rank and a DataLoader worker within it."""

    rank: int = 0
    world_size: int = 1
    worker: int = 0
    num_workers: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"shard rank={self.rank} must be in [0, world_size={self.world_size})")
        if self.num_workers < 1 or not 0 <= self.worker < self.num_workers:
            raise ValueError(f"shard worker={self.worker} must be in [0, num_workers={self.num_workers})")


def distributed_rank_world() -> tuple[int, int]:
    """This process's rank and the world size of the initialised ``torch.distributed`` group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def resolve_shard(shard: Shard | None, rank: int | None, world_size: int | None) -> tuple[Shard, str]:
    """The shard a loader serves, and where it came from: an explicit ``shard``, explicit ``rank`` and
    ``world_size``, or the initialised process group (so that every rank of a torchrun job reads its own
    share, not the whole dataset)."""
    if shard is not None:
        if rank is not None or world_size is not None:
            raise ValueError("pass either shard= or rank=/world_size=, not both")
        return shard, "shard="
    if (rank is None) != (world_size is None):
        raise ValueError(f"rank={rank!r} and world_size={world_size!r} go together: pass both or neither")
    if rank is not None and world_size is not None:
        return Shard(rank=rank, world_size=world_size), "rank=/world_size="
    r, w = distributed_rank_world()
    return Shard(rank=r, world_size=w), (PROCESS_GROUP if w > 1 else "no process group")


#: ``resolve_shard``'s word for a shard taken from the initialised process group (every rank builds one).
PROCESS_GROUP = "the torch.distributed process group"


#: A window is at most about half the dataset (``n // 2 - block``) but not cut below this many rows. A
#: dataset of under about two windows is one mix of all its rows, every block read and held as the epoch
#: starts; the cut keeps that to datasets of under ~2 x ``SMALL_WINDOW`` rows, whatever the window.
SMALL_WINDOW = 1024


def _edges(n: int, block: int, window: int) -> tuple[int, int, int]:
    """``block_order``'s cut: each block's spread, the blocks that start with the first, the others."""
    spread = min(window, n, max(n // 2 - block, SMALL_WINDOW))  # at most ~half the dataset, see SMALL_WINDOW
    edge = -(-spread // block) - 1  # blocks that start with the first
    later = -(-n // block) - 1 - edge  # the others, one every (n - spread) / later positions
    return spread, edge, later


def one_mix(n: int, block: int, window: int) -> bool:
    """Whether ``block_order`` of ``n`` rows is one mix of all of them (a dataset of under ~2 windows):
    every batch then draws from every block, as a full shuffle's do."""
    if block <= 1 or window <= block or n == 0:
        return False
    _, edge, later = _edges(n, block, window)
    return later <= edge


def block_order(n: int, block: int, window: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of ``range(n)`` read in blocks: the blocks of ``block`` contiguous rows in a random
    order, each block's rows spread at random over ``window`` positions from where the block's turn comes
    (as Mosaic Streaming's py1e spreads a shard), a new block starting every ~``block`` positions. At any
    point of the epoch about ``window / block`` blocks are being drawn from: a batch mixes rows of that
    many blocks, while a reader that fetches each block when its first row is due holds about half a
    window of rows, steadily. ``window <= block`` reads each block in storage order.

    The edges, so that the first and last batches are as mixed as the rest without a burst of reads:

    - the first ``window / block`` blocks all start at the beginning, each block's rows in storage order
      over its spread, so that a reader can fetch them in parts as they come due, each part a contiguous
      run (``blocks.BlockReads``), instead of all of them at once;
    - the blocks that start in the last two windows end together at the end, spread over the rest of the
      epoch from where their turns come, so none is read with a crowd of others.

    An empty dataset is an empty order (an epoch of zero batches), not a division by zero."""
    if n <= 0:
        return np.empty(0, np.int64)
    turn = np.empty(-(-n // block), np.int64)
    turn[rng.permutation(len(turn))] = np.arange(len(turn))  # each block's place in the epoch
    rows = np.arange(n, dtype=np.int64)
    if window <= block:
        return rows[np.lexsort((rows, turn[rows // block]))]
    spread, edge, later = _edges(n, block, window)
    draw = rng.uniform(0.0, 1.0, n)  # where in its block's spread a row comes
    if later <= edge:  # a dataset of under ~2 windows: one mix of all
        return rows[np.argsort(draw, kind="stable")]
    b = rows // block
    first = np.flatnonzero(turn[b] <= edge)  # the first blocks' rows, block by block
    draw[first] = draw[first[np.lexsort((draw[first], b[first]))]]  # each block's draws sorted, in row order
    starts = np.maximum(turn - edge, 0) * ((n - spread) / later)
    ends = np.where(starts > n - 2 * spread, float(n), starts + spread)
    keys = starts[b] + draw * (ends - starts)[b]
    return rows[np.argsort(keys, kind="stable")]


@dataclass(frozen=True)
class EpochSampler:
    """Computes the batches of indices that one shard reads in one epoch."""

    n: int
    batch_size: int
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    remainder: Remainder = "pad"
    shard: Shard = Shard()
    start: int = 0
    block: int = 1  # rows kept together in a shuffled order (1: a full shuffle)
    window: int = 1  # rows whose order is mixed at once, in whole blocks (<= block: none)
    taken: Ranges = ()  # positions of the order consumed by an earlier run (a resumed world), left out
    mix: EpochOrder | None = None  # the source's own order of each epoch (``MixedSource``), else None
    nodes: int = 1  # nodes the order is made for: each reads the same part of the blocks every epoch

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"start must be >= 0, got {self.start}")
        if self.n < 0:
            raise ValueError(f"dataset length must be >= 0, got {self.n}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.block < 1 or self.window < 1:
            raise ValueError(f"block={self.block} and window={self.window} must be >= 1")
        if self.remainder not in ("pad", "drop"):
            raise ValueError(f"remainder must be 'pad' or 'drop', got {self.remainder!r}")

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def left(self) -> int:
        """Positions of the epoch's order still to read: all ``n``, less those ``taken`` by an earlier run."""
        return self.n - sum(b - a for a, b in self.taken)

    @property
    def rank_samples(self) -> int:
        """Samples per rank per epoch (equal on every rank)."""
        w, m = self.shard.world_size, self.left
        if self.remainder == "pad":
            return -(-m // w) if m else 0
        return m // w

    @property
    def rank_batches(self) -> int:
        """Batches per rank per epoch (equal on every rank)."""
        s, b = self.rank_samples, self.batch_size
        return s // b if self.drop_last else -(-s // b)

    def __len__(self) -> int:
        """Batches this shard (rank and worker) yields per epoch."""
        total, w, k = self.rank_batches, self.shard.num_workers, self.shard.worker
        return len(range(self.start + k, total, w))

    # -- order -----------------------------------------------------------------------------------
    def order(self, epoch: int) -> np.ndarray:
        """The global order of all ``n`` indices in ``epoch`` (the same on every rank and worker)."""
        if self.mix is not None:
            return self.mix.order(self.seed, epoch, self.shuffle, self.block, self.window)
        if not self.shuffle:
            return np.arange(self.n, dtype=np.int64)
        if self.nodes > 1:
            return self.node_order(epoch)
        rng = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, epoch])
        if self.block <= 1:
            return rng.permutation(self.n).astype(np.int64)
        return block_order(self.n, self.block, self.window, rng)

    def node_order(self, epoch: int) -> np.ndarray:
        """The order of a world of ``nodes`` nodes (``engine.nodes``): node ``j``'s rows exactly fill the
        positions its ranks take (ranks take contiguous ranges, a node's ranks one after another), the same
        rows every epoch, in a block order of their own (``block_order``, as one node's). The rows are the
        nodes' parts of the blocks one after another, cut at the nodes' ranges: a block at a boundary is
        shared by two nodes, each keeping its own rows of it every epoch."""
        block, n, w = max(self.block, 1), self.n, self.shard.world_size
        per = -(-n // w) if self.remainder == "pad" else n // w  # a rank's positions (of all n: not ``left``)
        span = per * max(1, w // self.nodes)
        bounds = [min(n, j * span) for j in range(self.nodes)] + [n]  # the last node: the rest (dropped, or none)
        parts = node_parts(n, block, self.seed, self.nodes)
        seq = (np.concatenate(parts)[:, None] * block + np.arange(block)).reshape(-1)
        seq = seq[seq < n]  # (the dataset's last block, the only short one)
        out = []
        for j in range(self.nodes):
            rows = seq[bounds[j] : bounds[j + 1]]
            rng = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, epoch, j])
            perm = block_order(len(rows), block, self.window, rng) if block > 1 else rng.permutation(len(rows))
            out.append(rows[perm])
        return np.concatenate(out).astype(np.int64)

    def remaining(self) -> np.ndarray:
        """The positions of the order this world cuts among its ranks: those not ``taken``, in order, then
        the pad (the order's first positions again, cycling when there are fewer than ranks)."""
        keep = np.ones(self.n, dtype=bool)
        for a, b in self.taken:
            keep[a:b] = False
        left = np.flatnonzero(keep)
        pad = self.rank_samples * self.shard.world_size - len(left)
        if pad > 0:  # (with several nodes: the last node's own first positions, rows it keeps)
            w = self.shard.world_size
            first = 0 if self.nodes == 1 else (self.nodes - 1) * max(1, w // self.nodes) * -(-self.n // w)
            left = np.concatenate([left, (first + np.arange(pad, dtype=np.int64)) % self.n])
        return left

    def rank_positions(self) -> np.ndarray:
        """The positions of the epoch's order that this rank reads, in order (padded or cut by ``remainder``)."""
        per_rank = self.rank_samples
        start = self.shard.rank * per_rank
        return self.remaining()[start : start + per_rank]

    def rank_indices(self, epoch: int) -> np.ndarray:
        """This rank's samples for ``epoch``, in order, padded or truncated by ``remainder``."""
        if not self.n:
            return np.empty(0, dtype=np.int64)
        return self.order(epoch)[self.rank_positions()]

    def batches(self, epoch: int) -> list[list[int]]:
        """This shard's batches for ``epoch``: lists of dataset indices, in the order to yield them."""
        idx = self.rank_indices(epoch)
        b, w, k = self.batch_size, self.shard.num_workers, self.shard.worker
        return [idx[i * b : (i + 1) * b].tolist() for i in range(self.start + k, self.rank_batches, w)]
