"""The messages an epoch's pipeline hands its consumer, in one place: who sends what, and what it means.

The loop thread puts them on the epoch's ready queue; ``epoch.EpochIterator`` takes them off. A named
sentinel prints as its name in a debugger or a log, where an ``object()`` prints as an address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple


class Sentinel:
    """A unique marker with a readable name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


#: The epoch ended: every batch of the plan was delivered (or the pipeline was told to stop).
END = Sentinel("END")
#: Every sample of a batch was skipped (``on_error="skip"``): the consumer records the batch as taken.
EMPTY = Sentinel("EMPTY")


class Ready(NamedTuple):
    """A batch for the consumer: its number in the shard's plan, its sample count, the batch (or EMPTY)."""

    seq: int
    count: int
    batch: Any


@dataclass
class Failure:
    """An error to raise in the consumer, at the failed batch's place in the order."""

    exc: BaseException


__all__ = ["EMPTY", "END", "Failure", "Ready", "Sentinel"]
