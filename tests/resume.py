"""One helper that checks save/load of loader state at several points of an epoch, for every loader
shape (in the spirit of torchdata.nodes' test helper): at the start, in the middle, at the end and at an
epoch boundary, against an uninterrupted run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Resumable(Protocol):
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...


def ids(batches: list[Any]) -> list[list[int]]:
    return [b["index"].tolist() for b in batches]


def check_resume(
    make: Callable[[], Resumable], *, in_order: bool, epochs: int = 2, finished_restarts: bool = False
) -> None:
    """For each epoch and each save point, interrupt after ``k`` batches, restore into a *new* loader
    and check that taken + rest is the uninterrupted epoch (exactly, or as a set of batches).

    ``finished_restarts``: the loader's contract for a state saved after the epoch ended is "the next
    ``iter()`` is a fresh pass" (torchdata's StatefulDataLoader), not "nothing more of that epoch"."""
    ref = []
    base = make()
    for e in range(max(epochs, 2)):
        base.set_epoch(e)
        ref.append(ids(list(base)))
    for e in range(epochs):
        n = len(ref[e])
        for k in sorted({0, 1, n // 2, n - 1, n}):
            first = make()
            first.set_epoch(e)
            it = iter(first)
            taken = ids([next(it) for _ in range(k)])
            state = first.state_dict()
            it.close()  # with batches read ahead but never taken
            second = make()
            second.load_state_dict(state)
            second.set_epoch(e)  # what a training loop does after loading: must keep the resume point
            rest = ids(list(second))
            where = f"epoch {e}, saved after {k} of {n} batches"
            if in_order:
                assert taken + rest == ref[e], where
            else:
                got = sorted(map(tuple, taken + rest))
                assert got == sorted(map(tuple, ref[e])), where
            # The epoch after a resumed one is a whole, normal epoch.
            if e + 1 < epochs:
                second.set_epoch(e + 1)
                assert ids(list(second)) == ref[e + 1] if in_order else True, f"{where}: next epoch"
    # Saved at an epoch boundary (epoch finished): resuming yields nothing more of it.
    done = make()
    done.set_epoch(0)
    list(done)
    state = done.state_dict()
    again = make()
    again.load_state_dict(state)
    assert ids(list(again)) == (ref[0] if finished_restarts else [])
    again.set_epoch(1)
    assert len(ids(list(again))) == len(ref[1])
