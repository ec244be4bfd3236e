"""The pipeline's byte budget: how many batches may be alive (being read, decoded, or ready) at once.

Why a budget in bytes as well as batch slots: slots bound the number of batches, but a batch of large
images decoded at full size can be a hundred times its stored bytes, and the slot count that keeps a fast
store busy can then hold more memory than the machine has. So a new batch is admitted only while the
batches alive are estimated to fit ``limit`` bytes, at the bytes per sample seen so far: the bytes a read
returned, plus what an assembled batch holds per sample. Before any batch is assembled, the decoded size is
a guess from the first read (the decode stage's ``decoded_ratio``: headers say how large images decode).

One batch is always admitted, so a sample larger than the budget cannot deadlock; until the first read has
answered, the first batch is the only one alive. The counts are estimates per sample, so the bytes held may
pass the budget by about one batch.

The budget also keeps ``Stats.bytes_held`` (and its peak): the bytes read and not yet assembled, plus the
assembled batches not yet taken by the consumer. Lives on the loop thread, like the pipeline.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Mapping
from typing import Any

from .stats import Stats

#: ``decoded_ratio(part)``: decoded bytes per byte read, guessed from one read (the decode stage's).
DecodedRatio = Callable[[Mapping[str, Any]], float]


class ByteBudget:
    """Batches alive and the bytes they are estimated to cost, against ``limit`` bytes."""

    def __init__(
        self,
        limit: int,
        batch_size: int,
        stats: Stats,
        decoded_ratio: DecodedRatio | None = None,
        held: Callable[[], int] | None = None,
    ) -> None:
        self.limit = limit
        self._held = held  # bytes held outside batches (rows the read stage read ahead), within the limit too
        self.batch_size = batch_size
        self.stats = stats
        self.alive = 0  # batches admitted and not yet taken by the consumer
        self._decoded_ratio = decoded_ratio
        self._read_cost = 0.0  # bytes read per sample (stored bytes, or the store's decoded arrays)
        self._out_cost = 0.0  # bytes per sample of assembled batches
        self._open = True  # False once the epoch stops: nothing waits on the budget any more
        self._room: asyncio.Future[None] | None = None
        self._ready_bytes: collections.deque[int] = collections.deque()  # of delivered batches, in order
        stats.memory_budget = limit

    def fits(self) -> bool:
        """Whether one more batch may be admitted now."""
        if self.alive == 0 or not self._open:
            return True
        if not self._read_cost:  # nothing measured yet: the first batch alone
            return False
        per_batch = self.batch_size * (self._read_cost + self._out_cost)
        ahead = self._held() if self._held is not None else 0
        return (self.alive + 1) * per_batch + ahead <= self.limit

    async def room(self) -> None:
        """Wait (on the loop, blocking nothing) until one more batch fits."""
        while not self.fits():
            self._room = asyncio.get_running_loop().create_future()
            await self._room

    def admit(self) -> None:
        """A batch is issued: alive until the consumer takes it (``taken``)."""
        self.alive += 1

    def read(self, part: Mapping[str, Any], samples: int) -> int:
        """A read of ``samples`` samples answered: its bytes are held until its batch is assembled, and the
        first one sets the costs that let more batches in. Returns its bytes."""
        nbytes = part_bytes(part)
        self._hold(nbytes)
        first = not self._read_cost
        self._read_cost = max(self._read_cost, nbytes / max(1, samples), 1.0)  # > 0: measured
        if first:
            if not self._out_cost:
                ratio = self._decoded_ratio(part) if self._decoded_ratio is not None else 1.0
                self._out_cost = self._read_cost * ratio
            self._changed()
        return nbytes

    def assembled(self, read_bytes: int) -> None:
        """A batch's reads are no longer held (assembled into its batch, or failed)."""
        self.stats.bytes_held -= read_bytes

    def ready(self, batch: Any, count: int) -> None:
        """An assembled batch of ``count`` samples waits for the consumer: its tensors are held until then."""
        out_bytes = batch_bytes(batch)
        self._hold(out_bytes)
        if count:
            self._out_cost = max(self._out_cost, out_bytes / count)
        self._ready_bytes.append(out_bytes)

    def taken(self) -> None:
        """The consumer took a batch (or its failure): one batch less alive, its bytes no longer held."""
        self.alive -= 1
        if self._ready_bytes:
            self.stats.bytes_held -= self._ready_bytes.popleft()
        self._changed()

    def close(self) -> None:
        """The epoch stops: whatever waits for room goes on (to see that it stops)."""
        self._open = False
        self._changed()

    def _changed(self) -> None:
        if self._room is not None and not self._room.done():
            self._room.set_result(None)

    def _hold(self, nbytes: int) -> None:
        st = self.stats
        st.bytes_held += nbytes
        st.bytes_held_peak = max(st.bytes_held_peak, st.bytes_held)


def part_bytes(part: Mapping[str, Any]) -> int:
    """Bytes in a read result (``{column: ndarray, or a list of ndarrays or stored bytes}``)."""
    total = 0
    for value in part.values():
        if hasattr(value, "nbytes"):
            total += int(value.nbytes)
        else:
            total += sum(map(_sample_bytes, value))
    return total


def _sample_bytes(v: Any) -> int:
    """Bytes of one sample as read: an array's or a buffer's (a reader's answer arrives as a memoryview),
    or stored ``bytes``; anything else counts 0."""
    nbytes = getattr(v, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    return len(v) if isinstance(v, (bytes, bytearray)) else 0


def batch_bytes(batch: Any) -> int:
    """Bytes of the tensors in a batch (a dict of tensors or lists of them; anything else counts 0)."""
    if isinstance(batch, dict):
        return sum(batch_bytes(v) for v in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(batch_bytes(v) for v in batch)
    nbytes = getattr(batch, "nbytes", None)
    return int(nbytes) if isinstance(nbytes, int) else 0


__all__ = ["ByteBudget", "DecodedRatio", "batch_bytes", "part_bytes"]
