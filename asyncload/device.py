"""``DeviceFeed``: batches delivered already on the training device, copied ahead of the step that uses them.

Why this exists: the loader hands out CPU tensors. A plain ``batch.to("cuda")`` in the training loop is a
synchronous copy from pageable memory: the host stalls while the driver stages the bytes, and the GPU
idles meanwhile. ``DeviceFeed`` takes that off the critical path:

- **Pinned staging, reused.** A non-blocking host-to-device copy needs page-locked (pinned) memory.
  Pinning a fresh buffer per batch costs a ``cudaHostAlloc`` each time, so each batch tensor is copied
  into a small ring of pinned buffers kept per ``(shape, dtype)``; batches of one shape reuse them.
- **A side stream, a few batches ahead.** Copies are issued on a dedicated CUDA stream ``depth`` batches
  ahead of the one the consumer takes, so they overlap with the compute of the current step.
- **Never a half-copied batch.** When a batch is handed out, the consumer's *current* stream is made to
  wait on the event recorded after its copy (device-side wait: the host does not block), and every
  device tensor is ``record_stream``-ed on the consumer stream, so the caching allocator does not hand
  its memory to someone else while the consumer's kernels may still read it. A pinned buffer is only
  refilled once the copy that read it has completed (its event), so staging never overwrites bytes in
  flight.

On a machine without CUDA (or ``device="cpu"``) the very same path runs with the device steps left out:
tensors come back with the same values (made contiguous, the same object when they already are), no
pinning, no streams. Dtype conversion (``uint8`` images to ``float``) is deliberately *not* done here:
it belongs to the model step, where it runs on the device after the (4x smaller) uint8 copy.

``wait_s`` is the host time the consumer spent inside ``next()``: waiting for the upstream iterator and
staging. Divided by the step time it is the data-wait fraction a training loop reports.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ._closing import Closing
from .errors import ConfigError

__all__ = ["DeviceFeed", "map_tensors"]


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a nest of dicts, lists and tuples (their types and namedtuples
    kept); other leaves pass through unchanged. Tensors are visited in a stable order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        items = [(k, map_tensors(v, fn)) for k, v in obj.items()]
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:  # a mapping type that cannot be built from pairs
            return dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest, in a stable order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


_PENDING = object()  # a slot being filled for the batch now staged: its copy has no event yet


class _PinnedRing:
    """Pinned host buffers per tensor position and ``(shape, dtype)``, reused round-robin once the copy
    that read them has completed.

    Keying by the tensor's position in the batch means one batch takes at most one buffer per key, so
    ``per_key`` buffers (batches staged at once + 1) suffice; a refill waits on the oldest buffer's copy
    only when every buffer of that key is still being copied, which is back-pressure, not a stall. At
    most ``max_keys`` keys are kept (least recently used dropped) so that variable-shaped batches cannot
    grow pinned memory without bound. Dropping a buffer whose copy is still in flight is safe: PyTorch's
    pinned-memory allocator keeps the block until the copies recorded on it are done.
    """

    def __init__(self, per_key: int, max_keys: int = 64) -> None:
        self.per_key = per_key
        self.max_keys = max_keys
        self._rings: OrderedDict[tuple[Any, ...], deque[list[Any]]] = OrderedDict()
        self.allocations = 0

    def stage(self, position: int, t: torch.Tensor) -> tuple[torch.Tensor, list[Any]]:
        """Copy ``t`` into a free pinned buffer; return it and its slot (the copy's event goes there)."""
        key = (position, tuple(t.shape), t.dtype)
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = deque()
            while len(self._rings) > self.max_keys:
                self._rings.popitem(last=False)
        self._rings.move_to_end(key)
        slot: list[Any] | None = None
        if ring and ring[0][1] is not _PENDING:
            event = ring[0][1]  # events complete in issue order on one stream: the oldest frees first
            if event.query() or len(ring) >= self.per_key:
                event.synchronize()  # returns at once when query() said done
                slot = ring.popleft()
        if slot is None:
            slot = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True), None]
            self.allocations += 1
        slot[1] = _PENDING
        slot[0].copy_(t)
        ring.append(slot)
        return slot[0], slot


@dataclass
class _Staged:
    batch: Any
    event: Any  # torch.cuda.Event | None


class DeviceFeed(Closing, Iterator[Any]):
    """Iterate ``batches`` (tensors nested in dicts/lists/tuples) with every tensor already on ``device``.

    ``depth``: batches whose copies are issued ahead of the one handed out (0: copy on demand).
    ``pin_memory``: stage CPU tensors through reused pinned buffers before a CUDA copy (``None``: yes when
    ``device`` is CUDA). It only serves host-to-CUDA copies, so it is skipped for any other device and
    whenever CUDA is absent: the same code runs on CPU-only machines.

    ``wait_s`` accumulates the host seconds spent in ``next()`` (upstream wait + staging), ``batches``
    the number handed out. ``close()`` (also on ``del`` and at the end) closes the upstream iterator when
    it has a ``close()``, which stops an asyncload epoch's loop thread at once.
    """

    def __init__(
        self,
        batches: Iterable[Any],
        device: str | torch.device,
        depth: int = 2,
        pin_memory: bool | None = None,
    ) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ConfigError(f"depth={depth!r} is not allowed: an int >= 0")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"device={device!r} is not allowed: a torch device such as 'cpu' or 'cuda:0' ({exc})"
            ) from None
        self._cuda = self.device.type == "cuda"
        if self._cuda and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} is not allowed: CUDA is not available here; use 'cpu'")
        if self._cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.depth = depth
        # Pinned staging only serves host-to-CUDA copies; without CUDA it is skipped, whatever was asked.
        self.pin_memory = self._cuda and (pin_memory is None or bool(pin_memory))
        self._source: Iterator[Any] = iter(batches)
        self._queue: deque[_Staged] = deque()
        self._ring = _PinnedRing(per_key=depth + 2) if self.pin_memory else None
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._exhausted = False
        self._closed = False
        self.wait_s = 0.0
        self.batches = 0

    @property
    def pinned_allocations(self) -> int:
        """Pinned buffers allocated so far (stays flat when batch shapes repeat)."""
        return self._ring.allocations if self._ring is not None else 0

    # -- staging -----------------------------------------------------------------------------------
    def _to_device(self, t: torch.Tensor, slots: list[list[Any]]) -> torch.Tensor:
        if t.device == self.device:
            return t.contiguous()
        if self._ring is not None and t.device.type == "cpu" and not t.is_pinned():
            t, slot = self._ring.stage(len(slots), t)
            slots.append(slot)
        return t.to(self.device, non_blocking=self._cuda and t.is_pinned()).contiguous()

    def _stage(self, batch: Any) -> _Staged:
        slots: list[list[Any]] = []  # pinned buffers this batch's copies read, in tensor order
        if self._stream is None:
            return _Staged(map_tensors(batch, lambda t: self._to_device(t, slots)), None)
        with torch.cuda.stream(self._stream):
            out = map_tensors(batch, lambda t: self._to_device(t, slots))
            event = torch.cuda.Event()
            event.record(self._stream)
        for slot in slots:  # each pinned buffer may be refilled once this copy is done
            slot[1] = event
        return _Staged(out, event)

    def _handoff(self, staged: _Staged) -> Any:
        """Make the consumer's stream wait for the copy and tell the allocator who uses the memory."""
        if staged.event is not None:
            consumer = torch.cuda.current_stream(self.device)
            consumer.wait_event(staged.event)
            for t in _tensors(staged.batch):
                if t.device.type == "cuda":
                    t.record_stream(consumer)
        return staged.batch

    # -- iteration ---------------------------------------------------------------------------------
    def __iter__(self) -> DeviceFeed:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            while not self._exhausted and len(self._queue) <= self.depth:
                try:
                    batch = next(self._source)
                except StopIteration:
                    self._exhausted = True
                    break
                self._queue.append(self._stage(batch))
            if not self._queue:
                self.close()
                raise StopIteration
            out = self._handoff(self._queue.popleft())
        finally:
            self.wait_s += time.perf_counter() - t0
        self.batches += 1
        return out

    def close(self) -> None:
        """Drop staged batches and close the upstream iterator (if it can be closed)."""
        if self._closed:
            return
        self._closed = True
        self._queue.clear()
        close = getattr(self._source, "close", None)
        if callable(close):
            close()

