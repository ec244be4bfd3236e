"""``MixedSource``: several sources read as one, each contributing a fixed share of every epoch.

What a segmentation run mixes: a real dataset with a synthetic one, several cities, several hospitals.
The source says *what* an epoch holds (``Composition``: each source's length and its exact count of rows
per epoch); the order of the epoch, which rows of each source come and how they interleave, is the
engine's (``engine.mixing.MixedOrder``), a pure function of (seed, epoch) like every epoch's order, so
ranks, DataLoader workers, fan-out workers and resume need nothing of their own for a mixture.

- **Exact counts**: source ``i`` gives its share of ``epoch_rows`` (default: the sources' lengths summed)
  by largest remainder, the same every epoch; weights default to the sources' lengths (each row once an
  epoch, the sources interleaved).
- **Positions**: the loader's positions name a source, a copy and a row at once: the ``c``-th copy of
  source ``i``'s row ``r`` (a source asked for more rows than it has repeats them, each repeat in a copy
  of its own) is position ``offsets[i] + c * strides[i] + r``, offsets and strides in whole blocks of the
  largest ``block_rows``, so a block of positions never spans two sources and block reads
  (``engine.blocks``) stay within one store, and no position comes twice in an epoch. ``len()`` is
  ``epoch_rows``, the positions an epoch has.
- **What a batch carries**: the sources' columns (named alike, or renamed by ``columns=``), ``"source"``
  (int64: the place of the row's source in the mapping, a column this source reads) and, as for every
  source, ``"index"``: the row within its own source (``row_ids``).
- **Versions**: the mixture's version names each source's version and the counts, so a state saved on a
  mixture does not resume on one whose sources or shares changed; None (unknown) where a source's version
  is. Its identity names each source's identity (``Source.identity``).
"""

from __future__ import annotations

import asyncio
import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

import numpy as np

from ..errors import ConfigError
from .base import Columns, Source

#: The column each batch of a mixture carries: which source a row came from.
SOURCE_COLUMN = "source"


@dataclass(frozen=True)
class Composition:
    """What one epoch of a mixture holds: per source (in the mapping's order) its length, its rows per
    epoch, the position of its first copy's row 0 and the positions between its copies."""

    names: tuple[str, ...]
    lengths: tuple[int, ...]
    counts: tuple[int, ...]
    offsets: tuple[int, ...]
    strides: tuple[int, ...]

    def locate(self, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each position's source (its place in the mapping) and row within that source."""
        pos = np.asarray(positions, dtype=np.int64)
        which = np.searchsorted(np.asarray(self.offsets, dtype=np.int64), pos, side="right") - 1
        rel = pos - np.asarray(self.offsets, dtype=np.int64)[which]
        return which, rel % np.asarray(self.strides, dtype=np.int64)[which]


def largest_remainder(total: int, weights: list[Fraction]) -> list[int]:
    """``total`` split in proportion to ``weights`` in whole numbers: each its quota rounded down, the rows
    left over to the largest fractional parts (ties to the earlier), so the counts sum to ``total``."""
    whole = sum(weights)
    quotas = [total * w / whole for w in weights]
    counts = [math.floor(q) for q in quotas]
    for i in sorted(range(len(weights)), key=lambda i: (-(quotas[i] - counts[i]), i))[: total - sum(counts)]:
        counts[i] += 1
    return counts


class MixedSource(Source[tuple[Source[Any], ...]]):
    """``sources`` (name → source) mixed by ``weights`` (name → a number > 0; default: their lengths) into
    epochs of ``epoch_rows`` rows (default: the sources' lengths summed); see the module doc.

    ``columns``: per source, a renaming of its columns to the mixture's (``{"synth": {"img": "images"}}``);
    after it every source must give the same columns, or ``ConfigError`` names what differs.

    A source asked for fewer rows than it has takes a different part of them each epoch and cycles: no
    row comes again before every row has come. One asked for more repeats each row ``k`` or ``k + 1``
    times. Each full batch keeps the proportions within 2 samples (``engine.mixing``).

    A real dataset and a synthetic one in one training, 70/30, 20,000 rows an epoch::

        real = DeepLakeSource("s3://bucket/cityscapes", columns=("images", "masks"))
        synth = DeepLakeSource("file:///data/synthetic", columns=("image", "label"))
        mix = MixedSource({"real": real, "synth": synth}, weights={"real": 0.7, "synth": 0.3},
                          epoch_rows=20_000, columns={"synth": {"image": "images", "label": "masks"}})
        loader = AsyncLoader(mix, batch_size=32, shuffle=True, seed=0)
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader:  # batch["source"]: 0 real, 1 synth; batch["index"]: the row in it
                ...
    """

    def __init__(
        self,
        sources: Mapping[str, Source[Any]],
        weights: Mapping[str, float] | None = None,
        epoch_rows: int | None = None,
        *,
        columns: Mapping[str, Mapping[str, str]] | None = None,
    ) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise ConfigError(f"sources={sources!r} is not allowed: a non-empty dict of name -> Source")
        for name, src in sources.items():
            if not isinstance(name, str) or not isinstance(src, Source):
                raise ConfigError(f"sources[{name!r}]={src!r} is not allowed: a Source under a str name")
        names = tuple(sources)
        if weights is None:
            self._weights: tuple[Fraction, ...] | None = None
        else:
            if set(weights) != set(names):
                raise ConfigError(
                    f"weights name {sorted(weights)}, the sources {sorted(names)}: give one weight per source"
                )
            for name, w in weights.items():
                if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
                    raise ConfigError(f"weights[{name!r}]={w!r} is not allowed: a finite number > 0")
            self._weights = tuple(Fraction(weights[n]) for n in names)
        if epoch_rows is not None and (
            isinstance(epoch_rows, bool) or not isinstance(epoch_rows, int) or epoch_rows < 1
        ):
            raise ConfigError(f"epoch_rows={epoch_rows!r} is not allowed: None or an int >= 1")
        renames = dict(columns or {})
        for name in renames:
            if name not in sources:
                raise ConfigError(f"columns[{name!r}] names no source: the sources are {list(names)}")
        self.sources: dict[str, Source[Any]] = dict(sources)
        #: per source, its column name → the mixture's
        self.renames: dict[str, dict[str, str]] = {
            n: {c: dict(renames.get(n, {})).get(c, c) for c in s.columns} for n, s in sources.items()
        }
        first = names[0]
        want = [self.renames[first][c] for c in sources[first].columns]
        for name in names:
            got = self.renames[name].values()
            if set(got) != set(want) or len(got) != len(want):
                missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
                raise ConfigError(
                    f"MixedSource: source {name!r} ({sources[name].url}) gives columns {sorted(got)}, source "
                    f"{first!r} gives {sorted(want)} (missing {missing}, extra {extra}); the sources must give the "
                    f"same columns: choose them with each source's columns=, or rename with columns={{{name!r}: "
                    f"{{'its name': 'the mixture name'}}}}"
                )
        if SOURCE_COLUMN in want:
            raise ConfigError(
                f"MixedSource: a column named {SOURCE_COLUMN!r} is not allowed: each batch's {SOURCE_COLUMN!r} names "
                f"the row's source; rename it with columns="
            )
        self.epoch_rows = epoch_rows
        self._composition: Composition | None = None
        url = "mix(" + ", ".join(f"{n}={s.url}" for n, s in sources.items()) + ")"
        super().__init__(url, (*want, SOURCE_COLUMN))
        self.fork_safe = all(s.fork_safe for s in sources.values())
        self.isolate_reads = any(s.isolate_reads for s in sources.values())

    # -- what an epoch holds ---------------------------------------------------------------------------
    def composition(self) -> Composition:
        """Each source's length, rows per epoch, offset and block (the sources opened here if need be)."""
        if self._composition is None:
            srcs = list(self.sources.values())
            lengths = tuple(len(s) for s in srcs)
            empty = [n for n, k in zip(self.sources, lengths, strict=True) if k == 0]
            if empty:
                raise ConfigError(f"MixedSource: source(s) {empty} have no rows; a mixture needs rows of each")
            weights = self._weights or tuple(Fraction(k) for k in lengths)
            total = self.epoch_rows if self.epoch_rows is not None else sum(lengths)
            counts = tuple(largest_remainder(total, list(weights)))
            align = self.block_rows
            offsets, strides, at = [], [], 0
            for k, c in zip(lengths, counts, strict=True):
                offsets.append(at)
                strides.append(-(-k // align) * align)
                at += strides[-1] * -(-c // k)  # a copy per pass over the source an epoch makes
            self._composition = Composition(tuple(self.sources), lengths, counts, tuple(offsets), tuple(strides))
        return self._composition

    def _open(self) -> tuple[Source[Any], ...]:
        opened = tuple(s.open() for s in self.sources.values())
        self.composition()
        self._check_images()
        return opened

    def _length(self, handle: Any) -> int:
        return sum(self.composition().counts)

    @property
    def store_key(self) -> str | None:
        """None: a mixture is not kept on the node block store as one dataset. Each of its sources keeps
        its rows under its own key (``engine.keeping``), shared with every other loader of that source."""
        return None

    @property
    def local(self) -> bool:
        """Whether every source is on this machine (then ``cache="auto"`` keeps none of them)."""
        return all(s.local for s in self.sources.values())

    def _version(self, handle: Any) -> str | None:
        """Each source's version and count, or None where a source cannot say its version: a mixture of
        data of unknown version is itself of unknown version (never a string that reads as a known one)."""
        versions = [s.version for s in self.sources.values()]
        if any(v is None for v in versions):
            return None
        counts = self.composition().counts
        return "mix(" + ", ".join(f"{n}={v}:{k}" for n, v, k in zip(self.sources, versions, counts, strict=True)) + ")"

    def _identity(self, handle: Any) -> str | None:
        """Each source's identity, ``?`` for one that has none; None where no source has one. A source of
        unknown identity is still told apart by its URL (in the mixture's) and its version."""
        idents = {n: s.identity for n, s in self.sources.items()}
        if all(i is None for i in idents.values()):
            return None
        return "mix(" + ", ".join(f"{n}={'?' if i is None else i}" for n, i in idents.items()) + ")"

    def _check_images(self) -> None:
        self.image_columns()

    def image_columns(self) -> Any:
        """The image and mask columns, under the mixture's names. Sources must agree on a column's role; a
        column whose stored codec differs between them is decoded by the stores (``stored=None``)."""
        from ..image.codecs import ImageColumn

        seen: dict[str, tuple[str, ImageColumn]] = {}
        out: dict[str, ImageColumn] = {}
        for name, src in self.sources.items():
            cols = {self.renames[name].get(c, c): ic for c, ic in src.image_columns().items()}
            for c, ic in cols.items():
                if c in seen and seen[c][1].role != ic.role:
                    raise ConfigError(
                        f"MixedSource: column {c!r} is {seen[c][1].role!r} in source {seen[c][0]!r} and {ic.role!r} "
                        f"in source {name!r}; a column must hold the same kind of data in every source"
                    )
                seen.setdefault(c, (name, ic))
                if out.get(c, ic) != ic:  # stored alike in every source, or each file says (JPEG or PNG)
                    both = {out[c].stored, ic.stored}
                    ic = ImageColumn(ic.role, "file" if both <= {"jpeg", "png", "file"} else None)
                out[c] = ic
        return out

    def row_ids(self, positions: list[int]) -> list[int]:
        which, rows = self.composition().locate(positions)
        srcs = list(self.sources.values())
        return [srcs[int(w)].row_ids([int(r)])[0] for w, r in zip(which, rows, strict=True)]

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        """Each source's rows read at once (concurrently), put back in the order asked, with ``"source"``;
        ``raw`` (names in this source) asked of each source under its own names."""
        which, rows = self.composition().locate(indices)
        srcs = list(self.sources.values())
        names = list(self.sources)
        groups = [(i, np.flatnonzero(which == i)) for i in range(len(srcs))]
        groups = [(i, at) for i, at in groups if len(at)]

        async def one(i: int) -> Columns:
            back = {v: k for k, v in self.renames[names[i]].items()}
            own = frozenset(back[c] for c in raw if c in back)
            return await srcs[i].read([int(r) for r in rows[which == i]], own)

        got = await asyncio.gather(*(one(i) for i, _ in groups))
        out: Columns = {}
        if len(groups) == 1:  # one source: its columns as they came (stacked arrays stay stacked)
            i = groups[0][0]
            out = {self.renames[names[i]][c]: v for c, v in got[0].items()}
        else:
            for (i, at), part in zip(groups, got, strict=True):
                for c, values in part.items():
                    col = out.setdefault(self.renames[names[i]][c], [None] * len(indices))
                    for k, v in zip(at, values, strict=True):
                        col[int(k)] = v  # type: ignore[index]
        out[SOURCE_COLUMN] = which.astype(np.int64)
        return out

    # -- the loader's hooks, answered from the sources -------------------------------------------------
    @property
    def opens_alike(self) -> bool:
        return all(s.opens_alike for s in self.sources.values())

    @property
    def reader_module(self) -> str:
        for s in self.sources.values():
            if s.isolate_reads:
                return s.reader_module
        return type(self).__module__

    def reader_copy(self) -> MixedSource:
        checked = copy.copy(self)  # through ``__getstate__``: no handle
        checked.sources = {n: s.reader_copy() for n, s in self.sources.items()}
        return checked

    @property
    def preferred_read_mode(self) -> Literal["row", "column"]:
        modes = {s.preferred_read_mode for s in self.sources.values()}
        return "row" if modes == {"row"} else "column"

    @property
    def block_rows(self) -> int:
        return max(max(1, s.block_rows) for s in self.sources.values())

    def configure(self, requests_in_flight: int, samples_in_flight: int | None = None) -> None:
        for s in self.sources.values():
            s.configure(requests_in_flight, samples_in_flight)

    @property
    def cancel_safe(self) -> bool:  # type: ignore[override]
        return all(s.cancel_safe for s in self.sources.values())

    def set_stall_timeout(self, seconds: float) -> None:
        for s in self.sources.values():
            s.set_stall_timeout(seconds)

    def outage(self) -> str | None:
        return next((o for o in (s.outage() for s in self.sources.values()) if o), None)

    def throttle_count(self) -> int:
        return sum(s.throttle_count() for s in self.sources.values())

    def retry_count(self) -> int:
        return sum(s.retry_count() for s in self.sources.values())

    def close(self) -> None:
        for s in self.sources.values():
            s.close()
        super().close()

    def __repr__(self) -> str:
        return f"MixedSource({self.sources!r}, epoch_rows={self.epoch_rows!r})"


def composition_of(source: Source[Any]) -> Composition | None:
    """The composition of a source that composes its epochs (a ``MixedSource``, or a reader process's
    stand-in for one, which answers ``composition``), else None."""
    get = getattr(source, "composition", None)
    return get() if callable(get) else None


__all__ = ["Composition", "MixedSource", "SOURCE_COLUMN", "composition_of", "largest_remainder"]
