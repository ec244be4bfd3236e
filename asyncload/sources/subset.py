"""``RangeSource``: rows ``[start, stop)`` of another source, as a source of its own (one split).

Positions are renumbered from 0, so shuffling, shards and resume count within the split; reads, errors
and each batch's ``"index"`` use the real row numbers of the dataset underneath.
"""

from __future__ import annotations

import copy
from typing import Any, Literal

from .base import Columns, Source


class RangeSource(Source[Any]):
    """Rows ``[start, stop)`` of ``inner``. Picklable like every source (``inner`` travels as its
    description); the loader's hooks (pool sizes, retry and throttle counts) go to ``inner``."""

    def __init__(self, inner: Source[Any], start: int, stop: int) -> None:
        super().__init__(inner.url, inner.columns)
        if not 0 <= start <= stop <= len(inner):
            raise ValueError(f"RangeSource: [{start}, {stop}) is not within the {len(inner)} rows of {inner.url}")
        self.inner, self.start, self.stop = inner, start, stop
        # A split of a store whose reads can crash is read in a reader process like the store itself.
        self.fork_safe, self.isolate_reads = inner.fork_safe, inner.isolate_reads

    def _open(self) -> Any:
        return self.inner.handle()

    def _length(self, handle: Any) -> int:
        return self.stop - self.start

    def _version(self, handle: Any) -> str | None:
        inner = self.inner.version
        return None if inner is None else f"{inner}[{self.start}:{self.stop}]"

    def _identity(self, handle: Any) -> str | None:
        return self.inner.identity  # a split is of the dataset underneath; its range is in the version

    def row_ids(self, positions: list[int]) -> list[int]:
        return self.inner.row_ids([self.start + i for i in positions])

    @property
    def store_key(self) -> str | None:
        """The dataset's own: a split's rows are the dataset's rows (``row_ids``), shared with every other
        split, query and column set of it on the node block store."""
        return self.inner.store_key

    def value_tag(self, column: str) -> str:
        return self.inner.value_tag(column)

    @property
    def local(self) -> bool:
        return self.inner.local

    @property
    def opens_alike(self) -> bool:
        return self.inner.opens_alike

    @property
    def reader_module(self) -> str:
        return self.inner.reader_module

    def reader_copy(self) -> RangeSource:
        checked = copy.copy(self)  # through ``__getstate__``: no handle; the range is checked already
        checked.inner = self.inner.reader_copy()
        return checked

    @property
    def preferred_read_mode(self) -> Literal["row", "column"]:
        return self.inner.preferred_read_mode

    @property
    def block_rows(self) -> int:
        return self.inner.block_rows  # positions map to the inner rows in order: blocks stay contiguous

    def image_columns(self) -> Any:
        return self.inner.image_columns()

    def configure(self, requests_in_flight: int, samples_in_flight: int | None = None) -> None:
        self.inner.configure(requests_in_flight, samples_in_flight)

    @property
    def cancel_safe(self) -> bool:  # type: ignore[override]
        return self.inner.cancel_safe

    def set_stall_timeout(self, seconds: float) -> None:
        self.inner.set_stall_timeout(seconds)

    def outage(self) -> str | None:
        return self.inner.outage()

    def throttle_count(self) -> int:
        return self.inner.throttle_count()

    def retry_count(self) -> int:
        return self.inner.retry_count()

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        return await self.inner.read([self.start + i for i in indices], raw)

    def __repr__(self) -> str:
        return f"RangeSource({self.inner!r}, {self.start}, {self.stop})"


__all__ = ["RangeSource"]
