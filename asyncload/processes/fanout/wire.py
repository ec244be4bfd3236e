"""What parent and worker say to each other, and how it travels.

Protocol (typed messages, one duplex ``Pipe`` per worker):
- parent → worker: ``StartEpoch(gen, epoch, skip, taken)``, ``ReadOne(gen, epoch, seq, indices, probe)`` (after a
  reader died: one batch, or part of one, read alone), ``Credit(gen)`` (one more batch may be sent),
  ``Cancel(gen)`` (stop that epoch), ``None`` or a closed pipe (exit);
- worker → parent: ``Beat(gen, silent_since)`` every tick while it works (see there);
  ``Batch(gen, seq, count, batch)``, then exactly one of ``End(gen, figures)``,
  ``Failed(gen, error)`` or ``Cancelled(gen)`` per ``StartEpoch`` (``Done(gen, seq, figures)``, ``Failed`` or
  ``Cancelled`` per ``ReadOne``), after which the worker is idle.
``gen`` numbers the pool's epochs; the parent drops any message whose ``gen`` is not the live epoch's, so
no batch of an abandoned epoch can reach the next one. ``Failed.error`` is a ``engine.protocol.Failure``, the
one error carrier: it pickles as data, so an exception the parent cannot rebuild still arrives.

Transport: pickled with ``ForkingPickler`` and torch's reductions (the ones a
``torch.multiprocessing.Queue`` uses; importing ``torch.multiprocessing`` registers them). Why pipes and
not one shared queue:
- the in-order merge reads one chosen worker; a shared queue would need a reorder buffer in the parent;
- ``multiprocessing.connection.wait`` sleeps on the pipes and the process sentinels together, so the
  parent wakes for a batch *or* a dead worker, never polls, and never hangs on a worker that is gone;
- flow control: a worker sends a batch only against a *credit* (``_CREDITS`` at the start of each epoch;
  one more each time the parent yields a batch of it), so batches in shared memory stay bounded. A
  ``multiprocessing.Queue`` buffers without bound in its feeder thread.

Zero pickled pixels: a tensor travels as the file descriptor of its shared-memory storage, passed over
the worker's own pipe with the message that names it (``_FdPickler``); torch unlinks the shm file right after
mapping it, so a crash leaves nothing in ``/dev/shm`` (a worker killed between the two does; the pool
removes those when it joins it). Workers allocate batch tensors in shared memory
from the start (``_shared_empty``, set with ``collate.set_allocator``), so sending copies nothing: one copy
per sample, from the store's buffer into the batch, as in one process. Tensors a custom ``collate_fn`` made
on the heap are moved to shared memory when pickled (one more copy); anything else is pickled by value.
Each tensor a consumer keeps holds one file descriptor, as with DataLoader workers.
"""

from __future__ import annotations

import io
import math
import multiprocessing.reduction
import os
import pickle
import socket
import struct
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from ...engine.protocol import Failure
from ...engine.stats import Stats

#: Batches a worker may have sent and the parent not yet yielded. Two keep a worker's next batch on its
#: way while the parent hands out the current one; the worker's own loader reads ahead meanwhile.
_CREDITS = 2
_STOP = None  # parent → worker: exit (closing the pipe means the same)


# -- messages --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StartEpoch:
    """Parent → worker: serve epoch ``epoch`` of your sub-shard, leaving out your batches ``skip``; ``taken``:
    the positions of the epoch's order an earlier world consumed (``EpochSampler.taken``), left out of the cut."""

    gen: int
    epoch: int
    skip: frozenset[int]
    taken: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class ReadOne:
    """Parent → worker: read positions ``indices`` of epoch ``epoch`` as your batch ``seq``, alone (no other
    read in flight), and answer ``Batch`` (unless ``probe``) then ``Done``. How the parent finds the batch,
    and then the rows, whose read kills a reader (``processes.fanout.iterator``): with one read in flight, a death names
    it. A ``probe`` only asks whether reading ``indices`` kills the reader: its data and errors are dropped."""

    gen: int
    epoch: int
    seq: int
    indices: tuple[int, ...]
    probe: bool = False


@dataclass(frozen=True)
class Credit:
    """Parent → worker: the parent yielded one of epoch ``gen``'s batches; you may send one more."""

    gen: int


@dataclass(frozen=True)
class Cancel:
    """Parent → worker: epoch ``gen`` is abandoned; stop it (or never start it) and answer ``Cancelled``."""

    gen: int


@dataclass(frozen=True)
class Batch:
    """Worker → parent: the worker's batch ``seq`` of epoch ``gen`` (``count`` samples)."""

    gen: int
    seq: int
    count: int
    batch: Any


@dataclass(frozen=True)
class End:
    """Worker → parent: epoch ``gen`` is done; ``figures`` are its loader's counters (``Stats``)."""

    gen: int
    figures: dict[str, Any]


@dataclass(frozen=True)
class Failed:
    """Worker → parent: epoch ``gen`` raised ``error``; the worker is idle and usable."""

    gen: int
    error: Failure


@dataclass(frozen=True)
class Done:
    """Worker → parent: the ``ReadOne`` of batch ``seq`` of epoch ``gen`` ended (its batch, if any, was sent;
    a batch whose samples were all skipped sends none); ``figures`` as ``End``'s. The worker is idle."""

    gen: int
    seq: int
    figures: dict[str, Any]


@dataclass(frozen=True)
class Beat:
    """Worker → parent, every tick while it works on a command and is not waiting for a credit: it lives,
    and its store reads have had no answer since ``silent_since`` (``time.monotonic()``, one clock for
    every process of the machine), or are answering (None: nothing in flight, or reads answered within the
    tick). How the parent tells a worker stuck in a read of a silent store (``recovery``) from one that
    is busy. Sent whatever the epoch (``gen`` is the worker's current one, -1 while it opens its store)."""

    gen: int
    silent_since: float | None


@dataclass(frozen=True)
class Cancelled:
    """Worker → parent: epoch ``gen`` stopped on ``Cancel``; the worker is idle."""

    gen: int


Terminal = (
    End | Failed | Cancelled | Done
)  # one per StartEpoch or ReadOne, the last message of that epoch (also for isinstance)


# -- the figures an End carries --------------------------------------------------------------------
#: ``Stats`` counters a worker reports at the end of an epoch and the parent adds up (byte peaks too: the
#: sum bounds what the workers held together).
_SUMMED = (
    "requests", "samples_read", "bytes_read", "hedges", "hedges_won", "skipped", "concurrency", "memory_budget",
    "bytes_held_peak", "cpu_loop_s", "cpu_decode_s", "cpu_collate_s", "remote_bytes", "node_hits", "node_misses",
    "node_not_kept", "node_corrupt", "node_read_bytes", "read_s", "decode_s", "augment_s", "transform_s", "collate_s",
    "cpu_workers", "wait_on_store_s", "wait_on_decode_s", "wait_on_augment_s", "wait_on_transform_s",
    "wait_on_collate_s", "wait_on_other_s",
)  # fmt: skip


def _figures(st: Stats) -> dict[str, Any]:
    return {f: getattr(st, f) for f in _SUMMED} | {
        "skipped_samples": st.skipped_samples, "latencies": list(st.latencies),
    }  # fmt: skip


def _add_figures(st: Stats, fig: dict[str, Any]) -> None:
    """Add a worker's ``_figures`` to the parent's ``st``."""
    for f in _SUMMED:
        setattr(st, f, getattr(st, f) + fig[f])
    st.skipped_samples.extend(fig["skipped_samples"][: st.MAX_SKIP_RECORDS - len(st.skipped_samples)])
    st.latencies.extend(fig["latencies"])


# -- transport: worker → parent -------------------------------------------------------------------
_incoming = threading.local()  # parent: the fds that came with the message being unpickled
_MAX_FDS = 250  # per sendmsg (the kernel takes at most 253)


def _storage_from_fd(index: int, nbytes: int) -> torch.UntypedStorage:
    """Unpickles a storage sent by ``_FdPickler``: maps the shared memory of the ``index``-th fd."""
    return torch.UntypedStorage._new_shared_fd_cpu(_incoming.fds[index], nbytes)


class _FdPickler(ForkingPickler):
    """``ForkingPickler`` (with torch's reductions) that sends each CPU tensor's shared-memory storage as
    a file descriptor passed over the pipe itself (SCM_RIGHTS), in the same message.

    Why not torch's own ``file_descriptor`` reduction: it pickles a ``DupFd`` that the receiver fetches
    from the sender's resource-sharer thread, one connection per tensor; that thread answers only when
    it gets the worker's GIL, which the worker's loop and CPU pool hold most of the time, so the parent
    waited on every tensor. Passed with the message, the fds arrive with it, and the parent can map a
    batch even after its worker died."""

    def __init__(self, file: io.BytesIO, fds: list[int]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self._fds = fds

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.UntypedStorage) and obj.device.type == "cpu" and obj.nbytes() > 0:
            fd, nbytes = obj._share_fd_cpu_()  # already shared for batches made by ``_shared_empty``
            self._fds.append(fd)
            return _storage_from_fd, (len(self._fds) - 1, nbytes)
        return NotImplemented


@dataclass
class _Channel:
    """One end of a worker's pipe, and a socket on the same fd for passing file descriptors."""

    conn: Connection

    def __post_init__(self) -> None:
        self.sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        self._sending = threading.Lock()  # a worker's batches and its beats come from two threads

    def send(self, msg: object) -> None:
        """``msg`` pickled, then the fds of its storages; the storages must live until this returns."""
        buf, fds = io.BytesIO(), []
        _FdPickler(buf, fds).dump(msg)
        with self._sending:
            self.conn.send_bytes(struct.pack("!I", len(fds)) + buf.getvalue())
            for i in range(0, len(fds), _MAX_FDS):
                multiprocessing.reduction.sendfds(self.sock, fds[i : i + _MAX_FDS])

    def recv(self) -> Any:
        data = self.conn.recv_bytes()
        (n,) = struct.unpack_from("!I", data)
        fds: list[int] = []
        try:
            while len(fds) < n:
                fds += multiprocessing.reduction.recvfds(self.sock, min(_MAX_FDS, n - len(fds)))
            _incoming.fds = fds
            return pickle.loads(memoryview(data)[4:])
        finally:
            _incoming.fds = ()
            for fd in fds:  # each mapping holds its own
                os.close(fd)

    def close(self) -> None:
        self.sock.close()
        self.conn.close()


# -- in the worker: batches allocated where they will travel -------------------------------------
def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor whose storage is in shared memory from the start, so that sending it copies nothing
    (``share_memory_()`` on a heap tensor would copy it). The same call DataLoader's collate uses."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # an empty storage cannot be mapped; torch pickles it without shared memory
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)
