"""``DeviceFeed``: batches delivered already on the training device, prepared on a thread of their own.

Why this exists: the loader hands out CPU tensors. A plain ``batch.to("cuda")`` in the training loop is a
synchronous copy from pageable memory, and a pinned staging copy made on the training thread is worse:
it costs a share of the loader's throughput (issue 12; figures: ``benchmarks/results/design_notes.md``),
while the training thread has nothing else to do in that time but wait. ``DeviceFeed`` takes all of it off that thread:

- **A pin thread, bounded and woken.** One thread (``asyncload-pin``) takes batches from the upstream
  iterator, copies each CPU tensor into a reused page-locked (pinned) buffer and issues its copy to the
  device with ``non_blocking=True`` on a side CUDA stream. Ready batches wait in a hand-off of at most
  ``max(depth, 1)`` batches; the thread sleeps on a condition when it is full and the consumer sleeps on
  it when it is empty (no polling). The training thread's ``next()`` only takes a ready batch.
- **Pinned buffers, reused.** Pinning a fresh buffer per batch costs a ``cudaHostAlloc`` each time, so
  staging goes through a small ring of pinned buffers per tensor position and ``(shape, dtype)``. A
  buffer is refilled only once the copy that read it has completed (its event); waiting for that blocks
  the pin thread, never the consumer.
- **Never a half-copied batch.** When a batch is handed out, the consumer's *current* stream is made to
  wait on the event recorded after its copies (a device-side wait: the host does not block), and every
  device tensor is ``record_stream``-ed on the consumer stream, so the caching allocator does not hand
  its memory to another allocation while the consumer's kernels may still read it.
- **Lifetimes.** The pin thread starts on the first ``next()`` and ends at the end of the upstream
  iterator, on ``close()``, ``with`` exit, garbage collection (the thread holds no reference to the
  feed) and on an upstream error, which the consumer's ``next()`` re-raises as the same exception object
  (its type kept). ``close()`` also closes the upstream iterator, which stops an asyncload epoch at once.

On a machine without CUDA, or with ``device="cpu"``, there is no thread, no pinning and no stream: the
feed is a pass-through that makes tensors contiguous (the same object when they already are), pulling
``depth`` batches ahead like the CUDA path does. Dtype conversion (``uint8`` images to ``float``) is
not done unless asked: ``normalize=``, ``layout=`` and ``dtype=`` (the loader's settings of the same
names, ``normalize``) make the image columns model-ready here, on the device after the (2-4x smaller)
uint8 copy, on the side stream, so neither the loader's CPU pool nor the training thread does it.

``wait_s`` is the host time the consumer spent blocked in ``next()`` for its next batch: on the CUDA
path the wait for the pin thread, nothing else. It is the data-wait figure of a training loop.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from .engine.progress import EpochProgress, with_progress
from .engine.protocol import END, Failure, Sentinel
from .engine.stats import verdict
from .errors import ConfigError
from .image.normalize import ModelReady
from .runtime.loop import ExitOrder, on_exit, start_thread

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


#: A pinned slot being filled for the batch now staged: its copy has no event yet.
PENDING = Sentinel("PENDING")


class _PinnedRing:
    """Pinned host buffers per tensor position and ``(shape, dtype)``, reused round-robin once the copy
    that read them has completed. Used by the pin thread alone.

    Keying by the tensor's position in the batch means one batch takes at most one buffer per key, so
    ``per_key`` buffers (batches staged at once + 1) suffice; a refill waits on the oldest buffer's copy
    only when every buffer of that key is still being copied, which is back-pressure on the pin thread.
    At most ``max_keys`` keys are kept (least recently used dropped) so that variable-shaped batches
    cannot grow pinned memory without bound. Dropping a buffer whose copy is still in flight is safe:
    PyTorch's pinned-memory allocator keeps the block until the copies recorded on it are done.
    """

    def __init__(self, per_key: int, max_keys: int = 64) -> None:
        self.per_key = per_key
        self.max_keys = max_keys
        self._rings: OrderedDict[tuple[Any, ...], deque[list[Any]]] = OrderedDict()

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
        if ring and ring[0][1] is not PENDING:
            event = ring[0][1]  # events complete in issue order on one stream: the oldest frees first
            if event.query() or len(ring) >= self.per_key:
                event.synchronize()  # returns at once when query() said done
                slot = ring.popleft()
        if slot is None:
            slot = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True), None]
        slot[1] = PENDING
        _host_copy(slot[0], t)
        ring.append(slot)
        return slot[0], slot


def _host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy on this thread alone, the GIL released (numpy). Torch's CPU ``copy_`` of a batch-sized tensor
    fans out over its OpenMP pool, one thread per core, whose threads then spin-wait, which costs CPU
    per sample and loader throughput on many-core machines (figures: benchmarks/results/design_notes.md).
    Dtypes numpy lacks (bfloat16) fall back to ``copy_``."""
    try:
        np.copyto(dst.numpy(), src.numpy())
    except TypeError:
        dst.copy_(src)


class _Handoff:
    """A bounded buffer between the pin thread and the consumer: both sleep on one condition, never poll.

    ``put`` blocks while ``size`` items wait and returns False once the hand-off is stopped (the pin
    thread then ends); ``stop`` drops waiting items and wakes everyone."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cond = threading.Condition()
        self._items: deque[Any] = deque()
        self.stopped = False

    def put(self, item: Any) -> bool:
        with self._cond:
            while len(self._items) >= self.size and not self.stopped:
                self._cond.wait()
            if self.stopped:
                return False
            self._items.append(item)
            self._cond.notify_all()
            return True

    def get(self) -> Any:
        with self._cond:
            while not self._items:
                self._cond.wait()
            item = self._items.popleft()
            self._cond.notify_all()
            return item

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._items.clear()
            self._cond.notify_all()


class _Stager:
    """Moves one batch to the device: pinned staging and copies on the side stream (CUDA), or only
    ``contiguous()`` (CPU). The CUDA half runs on the pin thread."""

    def __init__(
        self, device: torch.device, pin_memory: bool, per_key: int,
        ready: ModelReady | None = None, images: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.ready, self.images = ready, images
        self.device = device
        self.cuda = device.type == "cuda"
        self.ring = _PinnedRing(per_key) if pin_memory else None
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    def _to_device(self, t: torch.Tensor, slots: list[list[Any]]) -> torch.Tensor:
        if t.device == self.device:
            return t.contiguous()
        if self.ring is not None and t.device.type == "cpu" and not t.is_pinned():
            t, slot = self.ring.stage(len(slots), t)
            slots.append(slot)
        return t.to(self.device, non_blocking=self.cuda and t.is_pinned()).contiguous()

    def _model_ready(self, batch: Any) -> Any:
        """The image columns of a dict batch made model-ready where they now are (on the side stream)."""
        if self.ready is None or not isinstance(batch, dict):
            return batch
        return self.ready.batch(batch, self.images)

    def stage(self, batch: Any) -> tuple[Any, Any]:
        """The batch on the device, and the event recorded after its copies (None off CUDA)."""
        slots: list[list[Any]] = []  # pinned buffers this batch's copies read, in tensor order
        if self.stream is None:
            return self._model_ready(map_tensors(batch, lambda t: self._to_device(t, slots))), None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            out = self._model_ready(map_tensors(batch, lambda t: self._to_device(t, slots)))
            event = torch.cuda.Event(blocking=True)  # a wait on it (ring refill) sleeps instead of spinning
            event.record(self.stream)
        for slot in slots:  # each pinned buffer may be refilled once this copy is done
            slot[1] = event
        return out, event


def _image_names(upstream: Any, images: Iterable[str] | None, ready: ModelReady | None) -> tuple[str, ...]:
    """The columns a feed makes model-ready: ``images``, or the upstream loader's image columns."""
    if images is not None:
        return tuple(images)
    source = getattr(upstream, "source", None)
    if ready is None:
        return ()
    if source is None or not hasattr(source, "image_columns"):
        raise ConfigError(
            "DeviceFeed(normalize=..., layout=..., dtype=...) needs images=[column, ...] unless it reads an "
            f"AsyncLoader (it reads a {type(upstream).__name__})"
        )
    return tuple(c for c, col in source.image_columns().items() if getattr(col, "role", None) == "image")


def _progress_of(it: Iterator[Any]) -> EpochProgress | None:
    """A copy of an asyncload epoch's consumed batches, taken right after a ``next()`` of it (None for
    any other iterator): what a resume must skip once the consumer has the batch just taken."""
    state = getattr(it, "state", None)
    progress = state() if callable(state) else None
    return progress.copy() if isinstance(progress, EpochProgress) else None


class _Clock:
    """Where the thread that feeds the device spends its time (the pin thread's, or the consumer's off
    CUDA): waiting for the loader's next batch (``upstream_s``), staging and issuing the copies
    (``copy_s``, host seconds: a copy on the side stream runs on after it is issued). Batches after the
    first only: the first wait is the start-up."""

    def __init__(self) -> None:
        self.upstream_s = 0.0
        self.copy_s = 0.0
        self.batches = 0

    def next(self, source: Iterator[Any]) -> Any:
        t0 = time.perf_counter()
        batch = next(source)
        if self.batches:
            self.upstream_s += time.perf_counter() - t0
        self.batches += 1
        return batch

    def stage(self, stager: _Stager, batch: Any) -> tuple[Any, Any]:
        t0 = time.perf_counter()
        out = stager.stage(batch)
        self.copy_s += time.perf_counter() - t0
        return out


def _pin_thread(source: Iterator[Any], stager: _Stager, handoff: _Handoff, clock: _Clock) -> None:
    """The pin thread's body. It holds no reference to the ``DeviceFeed``, so dropping the feed stops it."""
    try:
        while not handoff.stopped:
            try:
                batch = clock.next(source)
            except StopIteration:
                handoff.put(END)
                return
            if handoff.stopped or not handoff.put((*clock.stage(stager, batch), _progress_of(source))):
                return
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised there with its type
        handoff.put(Failure(exc))
    finally:
        if handoff.stopped:  # closed mid-epoch: the upstream iterator may have been busy in this thread
            _close(source)


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if callable(close):
        try:
            close()
        except ValueError:  # a generator running in the pin thread: that thread closes it when it returns
            pass


class _Pinning:
    """The upstream iterator, the hand-off and the pin thread: what stopping a feed needs, held apart
    from the ``DeviceFeed`` so that its finaliser does not keep the feed alive."""

    def __init__(self, source: Iterator[Any], handoff: _Handoff | None, join_timeout: float) -> None:
        self.source = source
        self.handoff = handoff
        self.join_timeout = join_timeout
        self.thread: threading.Thread | None = None

    def stop(self) -> None:
        """Stop the pin thread, drop prepared batches and close the upstream iterator (if it can be closed)."""
        if self.handoff is not None:
            self.handoff.stop()
        _close(self.source)  # wakes a pin thread waiting upstream (an asyncload epoch stops at once)
        thread = self.thread
        # Not from the pin thread itself (a GC pass may run there), nor while the interpreter is being
        # torn down (a daemon thread cannot run Python any more then, so it would never be seen to end).
        if thread is not None and thread is not threading.current_thread() and not sys.is_finalizing():
            thread.join(self.join_timeout)


class DeviceFeed(Iterator[Any]):
    """Iterate ``batches`` (tensors nested in dicts/lists/tuples) with every tensor already on ``device``.

    ``depth``: batches prepared ahead of the one handed out. On CUDA, at most ``max(depth, 1)`` batches
    wait on the device, pinned, copied and ready, while the pin thread prepares the next. On the CPU,
    ``depth`` batches are pulled from upstream ahead (0: on demand).
    ``pin_memory``: stage CPU tensors through reused pinned buffers before a CUDA copy (``None``: yes when
    ``device`` is CUDA). It only serves host-to-CUDA copies, so it is skipped for any other device and
    whenever CUDA is absent: the same code runs on CPU-only machines.
    ``join_timeout``: seconds ``close()`` waits for the pin thread (it is a daemon thread, left to end on
    its own beyond that, e.g. while an upstream iterator that cannot be interrupted finishes a batch).
    ``normalize``, ``layout``, ``dtype``: as the loader's settings (``normalize.ModelReady``), applied to
    ``images`` (column names; default: the upstream ``AsyncLoader``'s image columns) after the copy.

    ``wait_s`` accumulates the host seconds the consumer was blocked in ``next()``, ``batches`` the number
    handed out. ``close()`` (also on ``with`` exit, ``del`` and at the end) stops the pin thread and closes
    the upstream iterator when it has a ``close()``, which stops an asyncload epoch's loop thread at once.
    """

    def __init__(
        self,
        batches: Iterable[Any],
        device: str | torch.device,
        depth: int = 2,
        pin_memory: bool | None = None,
        join_timeout: float = 10.0,
        *,
        normalize: Any = None,
        layout: Any = "NHWC",
        dtype: Any = None,
        images: Iterable[str] | None = None,
    ) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ConfigError(f"depth={depth!r} is not allowed: an int >= 0")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"device={device!r} is not allowed: a torch device such as 'cpu' or 'cuda:0' ({exc})"
            ) from None
        cuda = self.device.type == "cuda"
        if cuda and not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} is not allowed: CUDA is not available here; use 'cpu'")
        if cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.depth = depth
        self.join_timeout = join_timeout
        # Pinned staging only serves host-to-CUDA copies; without CUDA it is skipped, whatever was asked.
        self.pin_memory = cuda and (pin_memory is None or bool(pin_memory))
        self._upstream = batches
        self._source: Iterator[Any] = iter(batches)
        # The upstream epoch's consumed batches as of the last batch handed to the consumer (see state_dict).
        self._taken = _progress_of(self._source)
        ready = ModelReady.of(normalize, layout, dtype)
        self._stager = _Stager(
            self.device, self.pin_memory, max(depth, 1) + 3, ready, _image_names(batches, images, ready)
        )
        self._handoff = _Handoff(max(depth, 1)) if cuda else None
        self._pin = _Pinning(self._source, self._handoff, join_timeout)
        self._finalizer = on_exit(self, ExitOrder.WORK, self._pin.stop)
        self._ahead: deque[Any] = deque()  # the CPU path's batches pulled ahead
        self._exhausted = False
        self._closed = False
        self.wait_s = 0.0
        self.batches = 0
        self._clock = _Clock()
        self._steady_wait_s = 0.0  # ``wait_s`` without the first batch's
        self._step_s = 0.0  # the consumer's time between ``next()`` calls
        self._returned_at: float | None = None

    @property
    def thread(self) -> threading.Thread | None:
        """The pin thread (CUDA path, once started)."""
        return self._pin.thread

    def __iter__(self) -> DeviceFeed:
        return self

    def __enter__(self) -> DeviceFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        t0 = time.perf_counter()
        if self._returned_at is not None:
            self._step_s += t0 - self._returned_at
            self._returned_at = None
        try:
            item = self._next_cuda() if self._handoff is not None else self._next_cpu()
        finally:
            now = time.perf_counter()
            self.wait_s += now - t0
            if self.batches:
                self._steady_wait_s += now - t0
        self._returned_at = now
        if item is END:
            self.close()
            raise StopIteration
        self.batches += 1
        return item

    def _next_cpu(self) -> Any:
        while not self._exhausted and len(self._ahead) <= self.depth:
            try:
                batch = self._clock.next(self._source)
                self._ahead.append((self._clock.stage(self._stager, batch)[0], _progress_of(self._source)))
            except StopIteration:
                self._exhausted = True
        if not self._ahead:
            return END
        batch, self._taken = self._ahead.popleft()
        return batch

    def _next_cuda(self) -> Any:
        assert self._handoff is not None
        if self._pin.thread is None:
            self._pin.thread = start_thread(
                _pin_thread, self._source, self._stager, self._handoff, self._clock, name="asyncload-pin"
            )
        item = self._handoff.get()
        if isinstance(item, Failure):
            self.close()
            raise item.exc
        if item is END:
            return item
        batch, event, self._taken = item
        # The consumer's stream waits for the copy on the device; the allocator learns who reads the memory.
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(event)
        for t in _tensors(batch):
            if t.device.type == "cuda":
                t.record_stream(consumer)
        return batch

    def stats(self) -> dict[str, Any]:
        """The upstream loader's ``stats()`` (when it has one), seen from this feed's consumer, the training
        loop: ``steady_wait_s``, ``step_s`` and ``consumer_wait_frac`` are the training loop's own in this
        feed's ``next()`` (the loader's consumer is the feed's thread); ``copy_s`` the host seconds staging
        and issuing the copies to the device; ``copy_wait_frac`` the share of the feed thread's busy time
        spent waiting on the loader; ``waiting_on`` may be "copy" (``engine.stats.verdict``)."""
        upstream = getattr(self._upstream, "stats", None)
        snap: dict[str, Any] = dict(upstream()) if callable(upstream) else {}
        clock = self._clock
        step = self._step_s + (time.perf_counter() - self._returned_at if self._returned_at is not None else 0.0)
        wait = self._steady_wait_s
        feeding = clock.upstream_s + clock.copy_s
        snap.update(
            batches_yielded=self.batches, steady_wait_s=wait, step_s=step,
            consumer_wait_frac=wait / (wait + step) if wait + step > 0 else None,
            copy_s=clock.copy_s, copy_wait_frac=clock.upstream_s / feeding if feeding > 0 else None,
        )  # fmt: skip
        snap["waiting_on"], snap["waiting_on_why"] = verdict(snap)
        return snap

    def state_dict(self) -> dict[str, Any]:
        """The upstream ``AsyncLoader``'s resume state as of the batches this feed handed out.

        The feed takes batches from the loader ahead of the training step (``depth``), so the loader's
        own ``state_dict()`` counts batches the step never saw, and a resume from it would skip them.
        Checkpoint this instead and load it with the loader's ``load_state_dict``."""
        owner = getattr(self._upstream, "state_dict", None)
        if owner is None:
            raise ConfigError(
                f"DeviceFeed.state_dict() needs a loader with state_dict() upstream (an AsyncLoader); "
                f"this feed reads a {type(self._upstream).__name__}"
            )
        state = owner()
        return with_progress(state, self._taken) if self._taken is not None else state

    def close(self) -> None:
        """Stop the pin thread, drop prepared batches and close the upstream iterator (if it can be closed)."""
        if self._closed:
            return
        self._closed = True
        self._ahead.clear()
        self._finalizer()
