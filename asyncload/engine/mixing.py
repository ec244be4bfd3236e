"""The order of a mixed epoch (``sources.mixed.MixedSource``): which rows of each source come, and how the
sources interleave. A pure function of (seed, epoch), like every epoch's order (``sampler``), so every rank
and worker computes the same one and a resume state needs nothing of the mixture but its version.

Which rows of source ``i`` (``n`` rows, ``c = k * n + r`` of them per epoch): every row ``k`` times (``k``
passes, each a permutation of its own) and ``r`` more, distinct, taken in *cycles* of ``m = ceil(n / r)``
epochs: cycle ``q`` is one permutation seeded by ``(seed, i, q)``, and its ``j``-th epoch takes its items
``[j * r, (j + 1) * r)``, the last epoch of the cycle its last items and, after them, the cycle's first
again up to ``r``. So a source asked for fewer rows than it has takes a different part each epoch, no row
comes again before every row has come (100 rows an epoch of a 203-row source: epochs 0-2 cover all 203,
97 of them twice, the repeats at the end of epoch 2), and no row comes twice in an epoch unless the source
is asked for more rows than it has (then each comes ``k`` or ``k + 1`` times). Every pass is in block
order (``sampler.block_order``) with the loader's block (``shuffle_block``; "auto": the largest
``block_rows`` of the sources) and a window scaled by the source's share, so that once interleaved each
block's rows still come within about one ``shuffle_window`` of the mixed epoch: a Deep Lake source is read
in blocks as it would be alone, and block reads (``engine.blocks``) hold about half a window of rows
whatever the source. (A source that reads rows one by one, an object store, is cut in the same blocks: a
full shuffle of it would spread each block's rows over the whole epoch, and a block read would hold them
all that long.) Each pass is a copy of its own in the mixture's positions (``Composition``). Without
``shuffle`` the passes are in storage order.

How they interleave: source ``i``'s ``j``-th row of the epoch is given the key ``(j + u_i) / c_i`` (``u_i``
in ``(0, 1)``, drawn per epoch with ``shuffle``, else 1/2) and the epoch is sorted by key. Any run of ``L``
consecutive positions then holds ``L * c_i / N`` rows of source ``i`` within 2 (each prefix is within 1), so
every batch, of any rank, keeps the proportions; the sampler must not reshuffle it, and does not: it cuts
this order as it is (``EpochSampler.mix``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..sources.base import Source
from ..sources.mixed import Composition, composition_of
from .sampler import block_order

_FULL, _STREAM, _PHASE = 1, 2, 3  # what a generator is seeded for (a different draw each)


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, *key])


@dataclass(frozen=True)
class MixedOrder:
    """``sampler.EpochOrder`` of a ``Composition``: positions (``offsets[i] + copy * strides[i] + row``)."""

    mix: Composition

    def _pass(self, i: int, shuffle: bool, block: int, window: int, rng: np.random.Generator | None) -> np.ndarray:
        """One permutation of source ``i``'s rows."""
        n = self.mix.lengths[i]
        if not shuffle or rng is None:
            return np.arange(n, dtype=np.int64)
        b = block
        if b <= 1:
            return rng.permutation(n).astype(np.int64)
        share = self.mix.counts[i] / max(1, sum(self.mix.counts))
        return block_order(n, b, max(b, round(window * share)), rng)

    def rows(self, i: int, seed: int, epoch: int, shuffle: bool, block: int, window: int) -> np.ndarray:
        """Source ``i``'s rows in ``epoch`` in the order they come (see the module doc), each pass in a copy
        of its own: ``copy * strides[i] + row``."""
        n, c, stride = self.mix.lengths[i], self.mix.counts[i], self.mix.strides[i]
        k, r = divmod(c, n)
        parts = [self._pass(i, shuffle, block, window, _rng(seed, _FULL, i, epoch, j)) for j in range(k)]
        if r:
            q, j = divmod(epoch, -(-n // r))  # the cycle, and this epoch's place in it
            cycle = self._pass(i, shuffle, block, window, _rng(seed, _STREAM, i, q))
            part = cycle[j * r : (j + 1) * r]
            parts.append(np.concatenate([part, cycle[: r - len(part)]]))
        return np.concatenate([p + copy * stride for copy, p in enumerate(parts)]) if parts else np.empty(0, np.int64)

    def order(self, seed: int, epoch: int, shuffle: bool, block: int, window: int) -> np.ndarray:
        m = self.mix
        phase = _rng(seed, _PHASE, epoch).uniform(0.0, 1.0, len(m.counts)) if shuffle else np.full(len(m.counts), 0.5)
        keys, which, positions = [], [], []
        for i, c in enumerate(m.counts):
            if not c:
                continue
            keys.append((np.arange(c) + phase[i]) / c)
            which.append(np.full(c, i))
            positions.append(m.offsets[i] + self.rows(i, seed, epoch, shuffle, block, window))
        if not keys:
            return np.empty(0, np.int64)
        at = np.lexsort((np.concatenate(which), np.concatenate(keys)))
        return np.concatenate(positions)[at]


def mixed_order(source: Source[object]) -> MixedOrder | None:
    """The order of a source that composes its epochs (``MixedSource``), else None (a permutation)."""
    mix = composition_of(source)
    return MixedOrder(mix) if mix is not None else None


__all__ = ["MixedOrder", "mixed_order"]
