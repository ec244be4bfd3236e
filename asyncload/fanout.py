"""Fan-out over processes: K worker processes, each running its own ``AsyncLoader`` on 1/K of the batches.

Why processes: one loader's loop thread and CPU pool share one GIL, so a transform written in Python (or
any per-sample work that holds the GIL) caps an epoch at one core however many reads are in flight.
Each worker process runs its own event loop, CPU pool and Deep Lake handle.

Why the batch sequence is unchanged: the sampler deals a shard's batches to its ``num_workers`` round-robin
(batch ``j`` to worker ``j % W``). Worker ``k`` of ``K`` serves the sub-shard ``worker = w + W * k``,
``num_workers = W * K``, which is exactly every K-th batch of the shard starting at ``k``: parent batch
``j`` is batch ``j // K`` of worker ``j % K``. Reading the workers round-robin (``in_order=True``)
therefore yields the same batches, in the same order, as one ``AsyncLoader`` with the same shard.
``in_order=False`` takes whichever worker's batch is ready first. Workers always run their own loader in
order, so the parent knows which batch every message is (needed for exact "held" indices on a crash).

Transport: one duplex ``Pipe`` per worker, pickled with ``ForkingPickler`` and torch's reductions (the
ones a ``torch.multiprocessing.Queue`` uses; importing ``torch.multiprocessing`` registers them). Why
pipes and not one shared queue:
- the in-order merge reads one chosen worker; a shared queue would need a reorder buffer in the parent;
- ``multiprocessing.connection.wait`` sleeps on the pipes and the process sentinels together, so the
  parent wakes for a batch *or* a dead worker, never polls, and never hangs on a worker that is gone;
- flow control: a worker sends a batch only against a *credit* (``_CREDITS`` each; one is returned when
  the parent yields a batch of it), so batches in shared memory stay bounded. A ``multiprocessing.Queue``
  buffers without bound in its feeder thread.

Zero pickled pixels: with the ``file_descriptor`` sharing strategy a tensor travels as the file
descriptor of its shared-memory storage (passed over a Unix socket); the shm file is unlinked as soon as
it is created, so a crash leaves nothing in ``/dev/shm``. Workers allocate batch tensors in shared memory
from the start (``collate.set_allocator``), so sending copies nothing: one copy per sample, from the
store's buffer into the batch, as in one process. Tensors a custom ``collate_fn`` made on the heap are
moved to shared memory when pickled (one more copy); anything else is pickled by value. Each tensor a
consumer keeps holds one file descriptor, as with DataLoader workers.

Lifetimes: workers start on the first ``next()``. ``close()`` (also at the end of the epoch, on an
error, ``break`` + garbage collection, Ctrl-C and interpreter exit) asks every worker to stop, waits
``timeout`` seconds, then sends SIGTERM, waits again, then SIGKILL, and joins them all. A worker only
exits when told to (or when the parent is gone), so the parent has fetched every batch it sent by then;
it leaves with ``os._exit`` after closing its loader, skipping an interpreter teardown that costs ~0.5 s
and, with Deep Lake 4.7.4, sometimes aborts.

Failures: an exception in a worker is re-raised in the parent with its type, its message and a note
naming the worker and carrying its traceback (at its place in the order when ``in_order``). A worker that
dies (SIGKILL, SIGSEGV on a corrupt chunk, SIGFPE on an empty one...) ends the epoch with ``WorkerError``
naming the worker, its pid, how it ended and the dataset indices of the batches it had not delivered.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import io
import logging
import math
import multiprocessing
import multiprocessing.resource_sharer
import multiprocessing.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from ._closing import Closing
from .collate import set_allocator
from .errors import ConfigError, ReadError, WorkerError, _short, _typed
from .loader import AsyncLoader
from .sampler import Shard
from .sources.base import Source
from .state import EpochProgress

log = logging.getLogger("asyncload")

#: Batches a worker may have sent and the parent not yet yielded. Two keep a worker's next batch on its
#: way while the parent hands out the current one; the worker's own loader reads ahead meanwhile.
_CREDITS = 2
_STOP = None  # parent → worker: stop (closing the pipe means the same)
_CONTEXTS = ("spawn", "forkserver")


def sub_shard(shard: Shard, k: int, processes: int) -> Shard:
    """The share of ``shard`` that worker ``k`` of ``processes`` serves: batches ``k, k + K, k + 2K, ...``
    of ``shard``'s sequence (see the module doc)."""
    return Shard(
        shard.rank, shard.world_size,
        worker=shard.worker + shard.num_workers * k, num_workers=shard.num_workers * processes,
    )  # fmt: skip


# -- in the worker ---------------------------------------------------------------------------------
def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor whose storage is in shared memory from the start, so that sending it copies nothing
    (``share_memory_()`` on a heap tensor would copy it). The same call DataLoader's collate uses."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # an empty storage cannot be mapped; torch pickles it without shared memory
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


class _ErrorPickler(pickle.Pickler):
    """Pickles the classes ``errors`` makes on the fly (``ReadError[KeyError]``: a ``ReadError`` that is
    also the failed read's built-in type) as the call that makes them again, so they keep both types."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type) and issubclass(obj, ReadError) and obj is not ReadError:
            others = [b for b in obj.__bases__ if b is not ReadError]
            if len(others) == 1 and _typed(others[0]) is obj:
                return _typed, (others[0],)
        return NotImplemented


@dataclass(frozen=True)
class _RemoteError:
    """An exception raised in a worker, in a form that always reaches the parent."""

    pickled: bytes | None  # None when the exception cannot be pickled and rebuilt
    type_name: str
    message: str
    traceback: str

    @classmethod
    def capture(cls, exc: BaseException) -> _RemoteError:
        buf = io.BytesIO()
        try:
            _ErrorPickler(buf, pickle.HIGHEST_PROTOCOL).dump(exc)
            pickle.loads(buf.getvalue())  # an exception whose __init__ wants other arguments fails here
            pickled: bytes | None = buf.getvalue()
        except Exception:  # noqa: BLE001 - fall back to type name, message and traceback
            pickled = None
        kind = type(exc)
        return cls(
            pickled, f"{kind.__module__}.{kind.__qualname__}", str(exc), "".join(traceback.format_exception(exc))
        )

    def rebuild(self, where: str) -> BaseException:
        """The worker's exception (or a ``WorkerError`` telling it), with a note naming the worker."""
        exc: BaseException | None = None
        if self.pickled is not None:
            try:
                exc = pickle.loads(self.pickled)
            except Exception:  # noqa: BLE001 - e.g. a class the parent cannot import
                exc = None
        if not isinstance(exc, BaseException):
            exc = WorkerError(f"asyncload: {where} raised {self.type_name}: {self.message}")
        exc.add_note(f"asyncload: raised in {where}; its traceback there:\n{self.traceback.rstrip()}")
        return exc


@dataclass(frozen=True)
class _WorkerSpec:
    """Everything one worker needs; pickled into the new process."""

    index: int
    source: Source[Any]
    loader_kwargs: dict[str, Any]
    shard: Shard
    epoch: int
    skip: frozenset[int]  # the worker's own sequence numbers to leave out
    credits: int


def _listen(conn: Connection, credits: threading.Semaphore, stop: threading.Event) -> None:
    """Worker's control thread: a credit per message; stop on ``_STOP`` or when the parent is gone."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = _STOP
        if msg is _STOP:
            stop.set()
            credits.release()  # wake the sender so that it sees ``stop``
            return
        credits.release()


def _send(conn: Connection, msg: tuple[Any, ...]) -> bool:
    """Send ``msg``; False when the parent closed the pipe (it is stopping us) or is gone."""
    try:
        conn.send(msg)
    except OSError:
        return False
    return True


def _serve(conn: Connection, spec: _WorkerSpec) -> None:
    """Iterate this worker's sub-shard and send its batches; then wait until the parent says stop."""
    import torch.multiprocessing as torch_mp  # registers torch's reductions with ForkingPickler

    torch_mp.set_sharing_strategy("file_descriptor")
    set_allocator(_shared_empty)
    # As in DataLoader workers: K processes each running torch ops on every core would oversubscribe.
    torch.set_num_threads(1)
    credits, stop = threading.Semaphore(spec.credits), threading.Event()
    threading.Thread(target=_listen, args=(conn, credits, stop), name="asyncload-fanout-control", daemon=True).start()
    try:
        loader = AsyncLoader(spec.source, shard=spec.shard, **spec.loader_kwargs)
        loader.set_epoch(spec.epoch)
        if spec.skip:  # resume: the loader leaves these batches out without reading them
            state = loader.state_dict()
            state["extra"] = sorted(spec.skip.union(state["extra"]))
            loader.load_state_dict(state)
        # Which batch each one yielded is: the loader marks every batch it consumed in ``progress``,
        # including a wholly skipped one (on_error="skip") that it never yields; it yields in order.
        expected = collections.deque(s for s in range(len(loader)) if s not in spec.skip)
        with iter(loader) as it:
            for batch in it:
                seq = -1
                while expected and it.progress.done(expected[0]):
                    seq = expected.popleft()
                credits.acquire()
                if stop.is_set() or not _send(conn, ("batch", seq, batch)):
                    return
                del batch  # the shared memory lives on in the message until the parent maps it
        if not _send(conn, ("end",)):
            return
    except BaseException as exc:  # noqa: BLE001 - every failure is the parent's to raise
        if stop.is_set() or not _send(conn, ("error", _RemoteError.capture(exc))):
            return
    stop.wait()  # exit only when told: the parent may still be fetching the batches sent


def _worker_main(conn: Connection, spec: _WorkerSpec) -> None:
    """Entry point of a worker process."""
    # Ctrl-C reaches the whole process group; the parent decides when its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        _serve(conn, spec)
    except BaseException:  # noqa: BLE001 - last resort: say it where a person will look
        traceback.print_exc()
        code = 1
    finally:
        try:
            multiprocessing.resource_sharer.stop(timeout=1.0)  # removes its socket file
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        # The loader is closed (reads in flight awaited): skip interpreter teardown, see the module doc.
        os._exit(code)


# -- in the parent ---------------------------------------------------------------------------------
@dataclass
class _Worker:
    index: int
    process: BaseProcess
    conn: Connection
    seqs: list[int]  # the parent sequence numbers this worker delivers, ascending (skips left out)
    next: int = 0  # position in ``seqs`` of the first batch not yet yielded
    pending: tuple[Any, ...] | None = None  # a message received ahead of its turn (in-order merge)
    ended: bool = False  # it sent "end": its loader yielded every batch it will

    @property
    def owes(self) -> bool:
        return self.next < len(self.seqs)


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}" + (" (its traceback is on stderr)" if exitcode else "")


def _stop_processes(procs: list[BaseProcess], timeout: float) -> None:
    """Join ``procs`` (already asked to stop); SIGTERM the ones still alive after ``timeout``, SIGKILL
    the ones still alive ``timeout`` later; release every process object."""
    for step in ("join", "terminate", "kill"):
        alive = [p for p in procs if p.exitcode is None]
        if not alive:
            break
        if step != "join":
            log.warning(
                "asyncload: fan-out workers %s did not stop within %.1fs: %s", [p.pid for p in alive], timeout, step
            )
            for p in alive:
                getattr(p, step)()
        deadline = time.monotonic() + timeout
        for p in alive:
            p.join(None if step == "kill" else max(0.0, deadline - time.monotonic()))
    for p in procs:
        p.close()


_live: weakref.WeakSet[FanoutEpoch] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    """Stop the workers of epochs still open at interpreter exit (before multiprocessing's own hook)."""
    for epoch in list(_live):
        try:
            epoch.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class FanoutEpoch(Closing, Iterator[Any]):
    """One epoch of ``AsyncLoader(source, shard=shard, **loader_kwargs)`` read by ``processes`` worker
    processes; yields the same batches (in the same order when ``in_order``).

    ``context``: "spawn" or "forkserver" (never "fork": forking where Deep Lake or an event loop is live
    hangs or segfaults). ``skip``: sequence numbers of this epoch's batches already consumed (resume):
    parent batch ``j`` is batch ``j // K`` of worker ``j % K``, whose loader leaves it out unread
    (``AsyncLoader.load_state_dict``).
    ``timeout``: seconds each step of stopping the workers may take (ask, then SIGTERM, then SIGKILL).
    ``transform`` and ``collate_fn`` must be picklable (defined at module level) to reach the workers.
    Use as an iterator and ``close()`` it, or as a context manager; ``break`` + garbage collection and
    interpreter exit also stop every worker.
    """

    def __init__(
        self,
        source: Source[Any],
        loader_kwargs: Mapping[str, Any],
        shard: Shard,
        epoch: int,
        processes: int,
        *,
        in_order: bool = True,
        context: str = "spawn",
        skip: frozenset[int] = frozenset(),
        timeout: float = 10.0,
        progress: EpochProgress | None = None,
    ) -> None:
        self._closed = True  # until fully built: __del__ must find a consistent object
        if context == "fork":
            raise ConfigError(
                "context='fork' is not allowed: forking a process where Deep Lake or an event loop is live "
                "hangs or segfaults; use 'spawn' (default) or 'forkserver'"
            )
        if context not in _CONTEXTS:
            raise ConfigError(f"context={context!r} is not allowed: 'spawn' or 'forkserver'")
        if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
            raise ConfigError(f"processes={processes!r} is not allowed: an int >= 1")
        if not timeout > 0:
            raise ConfigError(f"timeout={timeout!r} is not allowed: a number of seconds > 0")
        for key in ("shard", "processes"):
            if key in loader_kwargs:
                raise ConfigError(f"loader_kwargs[{key!r}] is not allowed: the fan-out sets each worker's {key}")
        if any(not isinstance(j, int) or j < 0 for j in skip):
            raise ConfigError(f"skip={sorted(skip)!r} is not allowed: batch sequence numbers (ints >= 0)")
        # Workers run their loaders in order so that every message names its batch (see the module doc).
        kwargs = {k: v for k, v in loader_kwargs.items() if k != "in_order"}
        # The same loader in this process validates the options now and gives the epoch's plan.
        plan = AsyncLoader(source, shard=shard, **kwargs)
        plan.set_epoch(epoch)
        self._batches: list[list[int]] = plan.sampler.batches(epoch)
        self._order = [j for j in range(len(self._batches)) if j not in skip]
        self._url = source.url
        self._k = processes
        self._in_order = in_order
        self._context = context
        self._timeout = float(timeout)
        self._specs: dict[int, tuple[_WorkerSpec, list[int]]] = {}
        for k in range(processes):
            sub = sub_shard(shard, k, processes)
            seqs = [j for j in self._order if j % processes == k]
            if not seqs:  # nothing to read: not worth a process
                continue
            own_skip = frozenset(j // processes for j in skip if j % processes == k and j < len(self._batches))
            spec = _WorkerSpec(k, source, kwargs, sub, epoch, own_skip, _CREDITS)
            self._specs[k] = (spec, seqs)
        try:
            ForkingPickler.dumps(next(iter(self._specs.values()))[0] if self._specs else None)
        except Exception as exc:
            raise ConfigError(
                f"processes={processes} needs loader options that can be pickled into a new process "
                f"({type(exc).__name__}: {exc}); define transform and collate_fn at module level"
            ) from exc
        self._workers: dict[int, _Worker] = {}
        self._pids: dict[int, int] = {}
        self._pos = 0  # in_order: position in ``_order`` of the next batch to yield
        self._rotate = 0  # in_order=False: where the next search for a ready worker starts
        self._pid = os.getpid()
        self._started = False
        self._progress = progress  # the parent's record of consumed batches (AsyncLoader.state_dict)
        self._closed = False

    # -- what a caller sees ----------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches this epoch yields (skipped ones left out)."""
        return len(self._order)

    @property
    def pids(self) -> dict[int, int]:
        """Worker index → pid of the workers this epoch started (empty before the first ``next()``;
        kept after ``close()``, for logs and for checking that they are gone)."""
        return dict(self._pids)

    def __iter__(self) -> FanoutEpoch:
        return self

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            if not self._started:
                self._start()
            batch = self._next_in_order() if self._in_order else self._next_ready()
        except BaseException:
            self.close()
            raise
        if batch is _DONE:
            self.close()
            raise StopIteration
        return batch

    def close(self) -> None:
        """Stop and join every worker (ask, SIGTERM, SIGKILL, ``timeout`` seconds apart); idempotent."""
        if self._closed:
            return
        self._closed = True
        _live.discard(self)
        workers, self._workers = list(self._workers.values()), {}
        if os.getpid() != self._pid:  # a forked copy of this object: the workers are not ours
            return
        for w in workers:
            try:
                w.conn.send(_STOP)
            except OSError:
                pass
            w.conn.close()  # also unblocks a worker stuck sending: it gets EPIPE
        _stop_processes([w.process for w in workers], self._timeout)


    # -- workers ---------------------------------------------------------------------------------
    def _start(self) -> None:
        self._started = True
        _live.add(self)
        ctx: Any = multiprocessing.get_context(self._context)  # SpawnContext or ForkServerContext
        # Workers inherit this process's multiprocessing temp dir (where the sockets that pass file
        # descriptors live) instead of making their own, which ``os._exit`` would leave behind.
        multiprocessing.util.get_temp_dir()
        for k, (spec, seqs) in self._specs.items():
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, args=(child_end, spec), name=f"asyncload-fanout-{k}", daemon=True)
            try:
                proc.start()
            except BaseException:
                parent_end.close()
                raise
            finally:
                child_end.close()  # the worker holds its end now; ours would hide its EOF
            self._workers[k] = _Worker(k, proc, parent_end, seqs)
            self._pids[k] = proc.pid  # type: ignore[assignment]

    def _name(self, w: _Worker) -> str:
        return f"fan-out worker {w.index} of {self._k} (pid {w.process.pid}) for {self._url}"

    def _give_credit(self, w: _Worker) -> None:
        try:
            w.conn.send(1)
        except OSError:
            pass  # it is gone: the next wait sees its sentinel

    def _receive(self, wanted: list[_Worker]) -> tuple[_Worker, tuple[Any, ...]]:
        """Block until one of ``wanted`` sends a message; raise ``WorkerError`` as soon as any worker that
        still owes batches dies. Sleeps in ``wait`` on pipes and process sentinels: no polling."""
        for w in wanted:
            if w.pending is not None:
                msg, w.pending = w.pending, None
                return w, msg
        while True:
            conns = {w.conn: w for w in wanted}
            sentinels = {w.process.sentinel: w for w in self._workers.values() if w.owes}
            ready = wait([*conns, *sentinels])
            readable = sorted((conns[r] for r in ready if r in conns), key=lambda w: (w.index - self._rotate) % self._k)
            for w in readable:
                try:
                    return w, w.conn.recv()
                except Exception as exc:  # noqa: BLE001 - EOF, or the fds of a dead sender are gone
                    self._died(w, exc)
            for r in ready:
                if r in sentinels:
                    self._died(sentinels[r], None)

    def _died(self, w: _Worker, cause: BaseException | None) -> None:
        """Raise the ``WorkerError`` for ``w``, whose pipe broke or whose process ended."""
        w.process.join(1.0)  # its sentinel is ready or its pipe closed: this reaps it
        if w.process.exitcode is None:  # alive, yet its message could not be read
            raise WorkerError(
                f"asyncload could not receive a batch from {self._name(w)}: {type(cause).__name__}: {cause}"
            ) from cause
        held = [i for j in w.seqs[w.next :] for i in self._batches[j]]
        err = WorkerError(
            f"asyncload {self._name(w)} {_how_it_ended(w.process.exitcode)} holding "
            f"{len(w.seqs) - w.next} undelivered batches of indices {_short(held)}"
        )
        err.worker, err.pid, err.exitcode, err.indices = w.index, w.process.pid, w.process.exitcode, held  # type: ignore[attr-defined]
        raise err from cause

    def _deliver(self, w: _Worker, msg: tuple[Any, ...]) -> Any:
        """The batch of a ``("batch", seq, batch)`` message; raises a worker's ``("error", ...)``."""
        if msg[0] == "error":
            raise msg[1].rebuild(self._name(w))
        at = msg[1] * self._k + w.index
        w.next = bisect.bisect_right(w.seqs, at)
        self._give_credit(w)
        if self._progress is not None:
            self._progress.mark(at)
        return msg[2]

    def _next_in_order(self) -> Any:
        while self._pos < len(self._order):
            j = self._order[self._pos]
            w = self._workers[j % self._k]
            msg: tuple[Any, ...] = ("end",)
            if not w.ended:
                _, msg = self._receive([w])
            if msg[0] == "batch":
                at = msg[1] * self._k + w.index
                if at > j:  # batch j never came (on_error="skip" left all of it out): keep this one for its turn
                    w.pending, msg = msg, ("skipped",)
                elif at < j:
                    raise WorkerError(f"asyncload {self._name(w)} sent batch {at} after batch {j} (out of order)")
            self._pos += 1
            if msg[0] in ("batch", "error"):
                return self._deliver(w, msg)
            if self._progress is not None:  # batch j was left out whole (on_error="skip"): consumed
                self._progress.mark(j)
            w.ended = w.ended or msg[0] == "end"  # it sends nothing more: its remaining turns are empty
            w.next = max(w.next, bisect.bisect_right(w.seqs, j))
        return _DONE

    def _next_ready(self) -> Any:
        while True:
            owing = [w for w in self._workers.values() if w.owes]
            if not owing:
                return _DONE
            w, msg = self._receive(owing)
            self._rotate = w.index + 1
            if msg[0] == "end":
                w.ended, w.next = True, len(w.seqs)
                continue
            return self._deliver(w, msg)


_DONE = object()

__all__ = ["FanoutEpoch", "sub_shard"]
