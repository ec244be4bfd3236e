"""``Plan``: everything one epoch's pipeline needs, fixed when the epoch starts.

``engine.shard.ShardEpochs`` makes it (which batches, how many indices per request, how many requests in
flight); ``pipeline``, ``hedging`` and ``assembly`` only read it.

``ReadStage`` is the part of the decode stage the pipeline uses, so that the pipeline needs no import of
the image package: what a read decodes to (for the byte budget), and which samples must be read again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # types only: the plan, like the pipeline that reads it, needs no import of the image package
    from ..image.decode import DecodeStage, Part, ReadAgain
    from ..sources.base import Source
    from .blocks import BlockReads
    from .collate import CollateFn, RaggedSpec, Transform
    from .options import OnError
    from .tuning import ConcurrencyTuner


@runtime_checkable
class ReadStage(Protocol):
    """What the pipeline asks of a stage that decodes what it reads (``image.decode.DecodeStage``)."""

    @property
    def encoded(self) -> frozenset[str]:
        """The columns its reads return as stored bytes (``Source.read``'s ``raw``)."""
        ...

    async def complete(self, part: Part, read_again: ReadAgain) -> Part:
        """One read made ready for assembly; samples it cannot use are read again through ``read_again``."""
        ...

    def decoded_ratio(self, part: Part) -> float:
        """Decoded bytes per byte read, guessed from one read (for the byte budget's first estimate)."""
        ...


@dataclass(frozen=True)
class Plan:
    """One epoch's work and how to do it."""

    source: Source[Any]
    batches: list[tuple[int, list[int]]]  # (sequence number in the shard's plan, indices)
    request_size: int  # indices per request (the public ``request_size``; 1 when reading row by row)
    fetchers: int  # fetcher tasks (the most requests that can ever be in flight)
    requests: int  # requests allowed in flight at the start (the tuner moves it)
    batch_size: int
    prefetch: int
    in_order: bool
    transform: Transform | None
    collate_fn: CollateFn | None
    with_index: bool
    on_error: OnError
    tuner: ConcurrencyTuner | None = None
    log_every: float | None = None
    hedge: float | None = 3.0  # hedge a read slower than this × recent p99 (None: never)
    hedge_min_s: float = 0.05
    ragged: RaggedSpec = None  # per-column policy for samples of unequal shapes (see ``collate``)
    stage: DecodeStage | None = None  # decode and augment image columns (see ``decode``); None: plain collate
    budget: int = 1 << 30  # bytes of batches alive (read, decoded, ready) the pipeline aims to stay within
    reads: BlockReads | None = None  # the read stage in front of ``source`` (blocks, the node store), or None
    stall_timeout: float = 120.0  # seconds with reads in flight and none answering before the epoch gives up

    def slots(self, requests: int) -> int:
        """Batches alive at once for ``requests`` in flight: prefetch + those being read + 1."""
        return self.prefetch + math.ceil(requests * self.request_size / self.batch_size) + 1


__all__ = ["Plan", "ReadStage"]
