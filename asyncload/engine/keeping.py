"""``Keeping``: where a source's rows lie on the node block store, so that the read stage speaks positions.

The store (``nodestore``) keeps a dataset's own rows under the dataset's key; the loader reads
positions of its source. Between the two: which shelf a position's row is on (a mixture's sources each keep
their rows on their own shelf, shared with any other loader of that source), which of the dataset's rows it
is (``Source.row_ids``: a split's or a query's positions name dataset rows), and which key each column is
kept under (its name in its own source, stored bytes or decoded values, and the settings that shaped the
decoded ones, ``Source.value_tag``). A column a mixture makes itself (``"source"``) is not kept: it is the
same for every row of a shelf, and is given back as a miss gives it.

Every method that touches the index or the disk blocks: the read stage calls those of the index on its loop's
lane thread (``runtime.loop.in_lane``: they take the index's lock anyway) and reads of rows on a pool thread.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..nodestore import BIN, Entry, Shelf, open_shelf
from ..runtime.log import log_once
from ..sources.base import Columns, Source
from ..sources.mixed import SOURCE_COLUMN, Composition, composition_of

#: A held claim: per route, the bins claimed on its shelf and the claim's holder.
Claim = list[tuple[int, list[int], str]]


@dataclass(frozen=True)
class Const:
    """A column value the store does not keep but knows: a mixture's ``"source"`` for a shelf's rows."""

    value: Any


@dataclass
class Route:
    """One shelf and the source whose rows it keeps; ``names``: the loader's column name -> the source's;
    ``consts``: columns the loader's source makes itself, with their value on this route."""

    shelf: Shelf
    source: Source[Any]
    names: dict[str, str]
    consts: dict[str, Any]


class Keeping:
    """The node store as one loader's source sees it: ``routes`` (one, or one per source of a mixture, whose
    ``composition`` places each position)."""

    def __init__(self, routes: list[Route], composition: Composition | None = None) -> None:
        self.routes = routes
        self.composition = composition

    @classmethod
    def open(cls, source: Source[Any], root: str | None, limit: int | None, *, asked: bool = False) -> Keeping | None:
        """``source``'s shelves, held in use (``release``); None where its rows are not kept (a version
        unknown, for a mixture any of its sources', or a store that cannot be used here). ``asked``: the
        user set ``cache=True``, so a source that cannot be kept is a warning, not a note."""
        comp = composition_of(source)
        mixed = getattr(source, "inner", source)  # (a reader process's stand-in holds the mixture)
        if comp is None or not hasattr(mixed, "sources"):
            shelf = _shelf(source, root, limit, asked)
            if shelf is None:
                return None
            return cls([Route(shelf, source, {c: c for c in source.columns}, {})])
        routes: list[Route] = []
        for i, (name, inner) in enumerate(mixed.sources.items()):
            shelf = _shelf(inner, root, limit, asked)
            if shelf is None:
                for r in routes:
                    r.shelf.release()
                return None
            names = {mine: theirs for theirs, mine in mixed.renames[name].items()}
            routes.append(Route(shelf, inner, names, {SOURCE_COLUMN: np.int64(i)}))
        return cls(routes, comp)

    # -- positions -----------------------------------------------------------------------------------
    def _place(self, positions: Sequence[int]) -> list[tuple[int, int]]:
        """Each position's route and the row of that route's source it reads (a position within it)."""
        if self.composition is None:
            return [(0, int(p)) for p in positions]
        which, rows = self.composition.locate(list(positions))
        return [(int(w), int(r)) for w, r in zip(which, rows, strict=True)]

    def valid(self, positions: Iterable[int]) -> list[int]:
        """``positions`` that name a row (a mixture's blocks end in positions that name none)."""
        positions = list(positions)
        if self.composition is None:
            return positions
        lengths = self.composition.lengths
        return [p for p, (w, r) in zip(positions, self._place(positions), strict=True) if r < lengths[w]]

    def _groups(self, positions: Sequence[int]) -> dict[int, tuple[list[int], list[int]]]:
        """Per route: the positions of ``positions`` on it, and the dataset rows they name."""
        out: dict[int, tuple[list[int], list[int]]] = {}
        for p, (w, r) in zip(positions, self._place(positions), strict=True):
            got = out.setdefault(w, ([], []))
            got[0].append(p)
            got[1].append(r)
        return {w: (ps, self.routes[w].source.row_ids(rs)) for w, (ps, rs) in out.items()}

    def _key(self, route: Route, column: str, raw: frozenset[str]) -> str:
        theirs = route.names[column]
        return f"{theirs}@b" if column in raw else f"{theirs}@a{route.source.value_tag(theirs)}"

    # -- the index and the disk ----------------------------------------------------------------------
    def lookup(self, positions: Sequence[int], raw: frozenset[str]) -> dict[int, dict[str, Entry | Const]]:
        """Of ``positions``, those on the node store for every column, with where each value lies."""
        found: dict[int, dict[str, Entry | Const]] = {}
        for w, (ps, ids) in self._groups(positions).items():
            route = self.routes[w]
            keys = {c: self._key(route, c, raw) for c in route.names}
            have = route.shelf.lookup(ids, list(keys.values()))
            for p, i in zip(ps, ids, strict=True):
                if i in have:
                    found[p] = {c: have[i][k] for c, k in keys.items()}
                    found[p].update((c, Const(v)) for c, v in route.consts.items())
        return found

    def get(self, where: dict[str, list[Entry | Const]]) -> dict[str, list[Any]]:
        """The values at ``where`` (per column), each checked (``CorruptPart`` names a part that fails)."""
        shelf = self.routes[0].shelf  # (any shelf reads any part: they share one store)
        out: dict[str, list[Any]] = {}
        for c, entries in where.items():
            stored = shelf.get([e for e in entries if isinstance(e, Entry)])
            it = iter(stored)
            out[c] = [e.value if isinstance(e, Const) else next(it) for e in entries]
        return out

    def put(self, positions: Sequence[int], got: Columns, raw: frozenset[str]) -> bool:
        """Keep the rows at ``positions`` (their values as the source read them, ``got``); False where the
        store did not keep them all (``Unkeepable`` where a value cannot be kept exactly)."""
        at = {p: k for k, p in enumerate(positions)}
        kept = True
        for w, (ps, ids) in self._groups(positions).items():
            route = self.routes[w]
            cols = {self._key(route, c, raw): [got[c][at[p]] for p in ps] for c in route.names if c not in route.consts}
            kept = route.shelf.put(ids, cols) and kept
        return kept

    def claim(self, positions: Sequence[int]) -> Claim | None:
        """The node-wide claim of the bins of ``positions`` before their fetch (all of them or none)."""
        taken: Claim = []
        for w, (_, ids) in self._groups(positions).items():
            bins = sorted({i // BIN for i in ids})
            holder = self.routes[w].shelf.claim(bins)
            if holder is None:
                self.unclaim(taken)
                return None
            taken.append((w, bins, holder))
        return taken

    def unclaim(self, claim: Claim) -> None:
        for w, bins, holder in claim:
            self.routes[w].shelf.unclaim(bins, holder)

    def forget(self, part: int) -> None:
        """Drop a part found corrupt (its rows are fetched again)."""
        self.routes[0].shelf.forget(part)

    @property
    def off(self) -> bool:
        """Whether the store was turned off in this process (a write or the index failed)."""
        return self.routes[0].shelf.off

    @property
    def limit(self) -> int:
        return self.routes[0].shelf.store.limit

    def room(self) -> int:
        """The limit less what the index and its log take: what rows may fill (``NodeStore.room``)."""
        return self.routes[0].shelf.store.room()

    def full(self) -> bool:
        """Whether the node's store has no room left for these rows (``NodeStore.full``): a new epoch then
        reads ahead within the budget from its start, rather than after its first write is refused."""
        return all(r.shelf.store.full(r.shelf.id) for r in self.routes)

    def quiet(self) -> None:
        """These rows are read through (the limit too small): no line says they are kept."""
        for r in self.routes:
            r.shelf.quiet()

    @property
    def where(self) -> str:
        return str(self.routes[0].shelf.store.root)

    def release(self) -> None:
        for r in self.routes:
            r.shelf.release()


def _shelf(source: Source[Any], root: str | None, limit: int | None, asked: bool) -> Shelf | None:
    """``source``'s shelf, or None where it is not kept, said once with the source's own reason
    (``unkept_reason``: a manifest gives no ETags) at WARNING where the user asked for the store."""
    key = source.store_key
    if key is None:
        why = getattr(source, "unkept_reason", None) or "its version is unknown"
        log_once(
            f"asyncload: {source.url} is not kept on the node block store: {why}; every epoch reads it from the store",
            logging.WARNING if asked else logging.INFO,
            key=f"not kept {source.url} {asked}",  # (a loader that asks for the store warns after one that did not)
        )
        return None
    return open_shelf(key, source.url, root, limit)


__all__ = ["Claim", "Const", "Keeping", "Route"]
