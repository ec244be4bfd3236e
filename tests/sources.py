"""Test sources: real Deep Lake reads behind a controlled delay (a user-defined Source, as users write them)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from asyncload import DeepLakeSource
from asyncload.sources.base import Columns


class DelayedSource(DeepLakeSource):
    """Reads a real Deep Lake dataset, each request delayed by ``delay(indices)`` seconds on the loop.

    Counts requests in flight, so tests can check the loader's bounds from the store's side.
    """

    def __init__(self, url: str, delay: Callable[[list[int]], float], **kw) -> None:
        super().__init__(url, **kw)
        self.delay = delay
        self.in_flight = 0
        self.max_in_flight = 0
        self.max_samples_in_flight = 0
        self._samples = 0

    async def read(self, indices: list[int]) -> Columns:
        self.in_flight += 1
        self._samples += len(indices)
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.max_samples_in_flight = max(self.max_samples_in_flight, self._samples)
        try:
            await asyncio.sleep(self.delay(indices))
            return await super().read(indices)
        finally:
            self.in_flight -= 1
            self._samples -= len(indices)


class FailingSource(DeepLakeSource):
    """A store where some samples cannot be read: a request containing any of ``bad`` fails with
    ``OSError``, as a real store fails a whole ranged GET when part of it is unreadable."""

    def __init__(self, url: str, bad: set[int], **kw) -> None:
        super().__init__(url, **kw)
        self.bad = set(bad)

    async def read(self, indices: list[int]) -> Columns:
        hit = sorted(self.bad.intersection(indices))
        if hit:
            raise OSError(f"unreadable object for sample {hit[0]}")
        return await super().read(indices)
