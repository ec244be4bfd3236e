"""Fan-out over processes: K persistent worker processes, each reading 1/K of every epoch's batches with
its own ``ShardReader`` (event loop, CPU pool, store handle).

Why processes: one loader's loop thread and CPU pool share one GIL, so a transform written in Python (or
any per-sample work that holds the GIL) caps an epoch at one core however many reads are in flight.
Each worker process runs its own event loop, CPU pool and Deep Lake handle.

Why persistent: a spawned worker imports torch and Deep Lake and opens the store (seconds, every time);
its store handle keeps Deep Lake's chunk caches and its loader keeps the concurrency tuner's setting. So a
``WorkerPool`` starts its workers once (on the first epoch's first ``next()``) and keeps them until it is
closed; each epoch is a message (``StartEpoch``: epoch number and the batches to leave out on resume).

Why the batch sequence is unchanged: the sampler deals a shard's batches to its ``num_workers`` round-robin
(batch ``j`` to worker ``j % W``). Worker ``k`` of ``K`` serves the sub-shard ``worker = w + W * k``,
``num_workers = W * K``, which is exactly every K-th batch of the shard starting at ``k``: parent batch
``j`` is batch ``j // K`` of worker ``j % K``. Reading the workers round-robin (``in_order=True``)
therefore yields the same batches, in the same order, as one ``AsyncLoader`` with the same shard.
``in_order=False`` takes whichever worker's batch is ready first. Workers always run their own loader in
order, so the parent knows which batch every message is (needed for exact "held" indices on a crash).

Protocol (typed messages, one duplex ``Pipe`` per worker):
- parent → worker: ``StartEpoch(gen, epoch, skip)``, ``Credit(gen)`` (one more batch may be sent),
  ``Cancel(gen)`` (stop that epoch), ``None`` or a closed pipe (exit);
- worker → parent: ``Batch(gen, seq, count, batch)``, then exactly one of ``End(gen, figures)``,
  ``Failed(gen, error)`` or ``Cancelled(gen)`` per ``StartEpoch``, after which the worker is idle.
``gen`` numbers the pool's epochs; the parent drops any message whose ``gen`` is not the live epoch's, so
no batch of an abandoned epoch can reach the next one.

An epoch abandoned mid-way (``break``, ``close()``, garbage collection, an exception raised by a worker)
is settled before the pool serves another: the parent sends ``Cancel`` to every worker still busy with it
and reads (and drops) their messages until each has answered with its terminal message. A worker sees
the cancel at its next credit wait, closes its epoch's iterator (reads in flight awaited) and goes idle.
Dropped batches are unpickled, which releases their shared memory. A worker that does not answer within
``timeout`` seconds, or dies, closes the whole pool: the next epoch starts fresh workers.

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
the worker's own pipe with the message that names it (``_FdPickler``); the shm file is unlinked as soon
as it is created, so a crash leaves nothing in ``/dev/shm``. Workers allocate batch tensors in shared memory
from the start (``collate.set_allocator``), so sending copies nothing: one copy per sample, from the
store's buffer into the batch, as in one process. Tensors a custom ``collate_fn`` made on the heap are
moved to shared memory when pickled (one more copy); anything else is pickled by value. Each tensor a
consumer keeps holds one file descriptor, as with DataLoader workers.

Lifetimes: ``WorkerPool.close()`` (also: garbage collection of the pool, interpreter exit at
``_loop.Stage.WORKERS``, after epochs stopped and before multiprocessing's own hook, a dead worker, Ctrl-C
in the consumer) asks every worker to stop, waits ``timeout`` seconds, then sends SIGTERM, waits again,
then SIGKILL, and joins them all. A worker exits only when told to (or when the parent is gone); it
leaves with ``os._exit`` after closing its loader, skipping an interpreter teardown that costs ~0.5 s
and, with Deep Lake 4.7.4, sometimes aborts. ``AsyncLoader(processes=K)`` owns one pool; a
``FanoutEpoch`` built on its own (``FanoutEpoch(source, ...)``) owns a private pool that it closes.

Failures: an exception in a worker is re-raised in the parent with its type, its message and a note
naming the worker and carrying its traceback (at its place in the order when ``in_order``); the workers
stay usable. A worker that dies (SIGKILL, SIGSEGV on a corrupt chunk, SIGFPE on an empty one...) ends the
epoch with ``WorkerError`` naming the worker, its pid, how it ended and the dataset indices of the
batches it had not delivered, and closes the pool.
"""

from __future__ import annotations

import bisect
import collections
import io
import logging
import math
import multiprocessing
import multiprocessing.reduction
import multiprocessing.resource_sharer
import multiprocessing.util
import os
import pickle
import queue
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from ._loop import Stage, on_exit, start_thread
from ._protocol import END, Failure
from .collate import set_allocator
from .epoch import Epoch
from .errors import ConfigError, WorkerError, _short
from .options import LoaderOptions
from .reader import ShardReader
from .sampler import EpochSampler, Shard
from .sources.base import Source
from .state import EpochProgress
from .stats import Stats

log = logging.getLogger("asyncload")

#: Batches a worker may have sent and the parent not yet yielded. Two keep a worker's next batch on its
#: way while the parent hands out the current one; the worker's own loader reads ahead meanwhile.
_CREDITS = 2
_STOP = None  # parent → worker: exit (closing the pipe means the same)
_CONTEXTS = ("spawn", "forkserver")


def _per_worker(options: LoaderOptions, processes: int) -> LoaderOptions:
    """One worker's options: in order (every message names its batch), no fan-out of its own, and its
    share of the samples in flight, so that K workers together keep what one process would: the same
    memory bound, and no K-fold burst of reads when every worker starts an epoch at once."""
    share = {"max_concurrency": max(1, options.max_concurrency // processes)}
    if options.concurrency != "auto":
        share["concurrency"] = max(1, int(options.concurrency) // processes)
    return options.replace(in_order=True, processes=0, **share)


def sub_shard(shard: Shard, k: int, processes: int) -> Shard:
    """The share of ``shard`` that worker ``k`` of ``processes`` serves: batches ``k, k + K, k + 2K, ...``
    of ``shard``'s sequence (see the module doc)."""
    return Shard(
        shard.rank, shard.world_size,
        worker=shard.worker + shard.num_workers * k, num_workers=shard.num_workers * processes,
    )  # fmt: skip


# -- messages --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StartEpoch:
    """Parent → worker: serve epoch ``epoch`` of your sub-shard, leaving out your batches ``skip``."""

    gen: int
    epoch: int
    skip: frozenset[int]


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
class Cancelled:
    """Worker → parent: epoch ``gen`` stopped on ``Cancel``; the worker is idle."""

    gen: int


Terminal = End | Failed | Cancelled  # one per StartEpoch, the last message of that epoch
_TERMINAL = (End, Failed, Cancelled)


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

    def send(self, msg: object) -> None:
        """``msg`` pickled, then the fds of its storages; the storages must live until this returns."""
        buf, fds = io.BytesIO(), []
        _FdPickler(buf, fds).dump(msg)
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


# -- in the worker ---------------------------------------------------------------------------------
def _shared_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new tensor whose storage is in shared memory from the start, so that sending it copies nothing
    (``share_memory_()`` on a heap tensor would copy it). The same call DataLoader's collate uses."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # an empty storage cannot be mapped; torch pickles it without shared memory
        return torch.empty(shape, dtype=dtype)
    storage = torch.UntypedStorage._new_shared(nbytes)
    return torch.empty(0, dtype=dtype).set_(storage).view(shape)


@dataclass(frozen=True)
class _WorkerSpec:
    """What one worker needs for its whole life; pickled into the new process. Epochs come as messages."""

    index: int
    source: Source[Any]
    options: LoaderOptions
    shard: Shard
    credits: int


class _Control:
    """The worker's view of the epoch in progress: its credits and whether it was cancelled. Written by the
    control thread (messages from the parent), waited on by the main thread before each send."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._gen = -1
        self._credits = 0
        self._cancelled = -1  # every epoch up to this gen is cancelled (gens only grow)
        self._stopped = False

    def _over(self, gen: int) -> bool:
        return self._stopped or gen <= self._cancelled

    def begin(self, gen: int, credits: int) -> bool:
        """Make ``gen`` the epoch in progress with ``credits``; False when it was cancelled already."""
        with self._cond:
            self._gen, self._credits = gen, credits
            return not self._over(gen)

    def take(self, gen: int) -> bool:
        """Wait for a credit of ``gen`` and use it; False when ``gen`` is cancelled or the worker stops."""
        with self._cond:
            self._cond.wait_for(lambda: self._over(gen) or self._credits > 0)
            if self._over(gen):
                return False
            self._credits -= 1
            return True

    def credit(self, gen: int) -> None:
        with self._cond:
            if gen == self._gen:  # a late credit of an earlier epoch means nothing now
                self._credits += 1
                self._cond.notify_all()

    def cancel(self, gen: int) -> None:
        with self._cond:
            self._cancelled = max(self._cancelled, gen)
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()


def _listen(conn: Connection, ctl: _Control, commands: queue.SimpleQueue[StartEpoch | None]) -> None:
    """Worker's control thread: epochs to the main thread, credits and cancels to ``ctl``; stop on
    ``_STOP`` or when the parent is gone."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = _STOP
        if isinstance(msg, StartEpoch):
            commands.put(msg)
        elif isinstance(msg, Credit):
            ctl.credit(msg.gen)
        elif isinstance(msg, Cancel):
            ctl.cancel(msg.gen)
        else:
            ctl.stop()
            commands.put(_STOP)
            return


class _ParentGone(Exception):
    """The pipe to the parent is closed: it is stopping this worker, or it is gone."""


def _send(channel: _Channel, msg: object) -> None:
    try:
        channel.send(msg)
    except OSError as exc:
        raise _ParentGone from exc


#: ``Stats`` counters a worker reports at the end of an epoch and the parent adds up.
_SUMMED = ("requests", "samples_read", "bytes_read", "hedges", "hedges_won", "skipped", "concurrency")


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


def _run_epoch(channel: _Channel, reader: ShardReader, ctl: _Control, cmd: StartEpoch) -> End | Cancelled:
    """Serve one epoch of this worker's sub-shard, one batch per credit."""
    total = len(reader.sampler)
    progress = EpochProgress(cmd.epoch, total)
    for j in cmd.skip:  # resume: these batches are left out without being read
        progress.mark(j)
    # Which batch each one yielded is: the epoch marks every batch it consumed in its progress,
    # including a wholly skipped one (on_error="skip") that it never yields; it yields in order.
    expected = collections.deque(s for s in range(total) if s not in cmd.skip)
    samples = 0
    with reader.epoch(cmd.epoch, progress) as it:
        for batch in it:
            seq = -1
            while expected and progress.done(expected[0]):
                seq = expected.popleft()
            count, samples = it.stats().samples_yielded - samples, it.stats().samples_yielded
            if not ctl.take(cmd.gen):
                return Cancelled(cmd.gen)  # leaving the ``with`` stops the epoch's reads
            _send(channel, Batch(cmd.gen, seq, count, batch))
            del batch  # the shared memory lives on in the message until the parent maps it
    return End(cmd.gen, _figures(it.stats()))


def _serve(conn: Connection, spec: _WorkerSpec) -> None:
    """Build this worker's loader once, then serve epochs as they are asked for until told to stop."""
    import torch.multiprocessing as torch_mp  # registers torch's reductions with ForkingPickler

    torch_mp.set_sharing_strategy("file_descriptor")
    set_allocator(_shared_empty)
    # As in DataLoader workers: K processes each running torch ops on every core would oversubscribe.
    torch.set_num_threads(1)
    ctl, commands = _Control(), queue.SimpleQueue[StartEpoch | None]()
    start_thread(_listen, conn, ctl, commands, name="asyncload-fanout-control")
    channel = _Channel(conn)
    reader: ShardReader | None = None
    broken: Failure | None = None
    try:
        reader = ShardReader(spec.source.open(), spec.options, spec.shard)
    except BaseException as exc:  # noqa: BLE001 - told to the parent at each epoch it asks for
        broken = Failure(exc)
    try:
        while (cmd := commands.get()) is not _STOP:
            outcome: Terminal
            if reader is None:
                assert broken is not None
                outcome = Failed(cmd.gen, broken)
            elif not ctl.begin(cmd.gen, spec.credits):
                outcome = Cancelled(cmd.gen)
            else:
                try:
                    outcome = _run_epoch(channel, reader, ctl, cmd)
                except _ParentGone:
                    return
                except BaseException as exc:  # noqa: BLE001 - every failure is the parent's to raise
                    outcome = Failed(cmd.gen, Failure(exc))
            _send(channel, outcome)
    except _ParentGone:
        return


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


# -- in the parent: the pool -----------------------------------------------------------------------
@dataclass
class _Proc:
    """One live worker process and the parent's end of its pipe."""

    index: int
    process: BaseProcess
    channel: _Channel

    @property
    def conn(self) -> Connection:
        return self.channel.conn


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


def _stop_workers(procs: dict[int, _Proc], timeout: float, owner_pid: int) -> None:
    """The pool's finaliser (it must not hold the pool): ask every worker to exit, then join them."""
    live = list(procs.values())
    procs.clear()
    if os.getpid() != owner_pid:  # a forked copy of the pool: the workers are not ours
        return
    for w in live:
        try:
            w.conn.send(_STOP)
        except OSError:
            pass
        w.channel.close()  # also unblocks a worker stuck sending: it gets EPIPE
    _stop_processes([w.process for w in live], timeout)


class WorkerPool:
    """``processes`` persistent worker processes, each reading its sub-shard (``sub_shard``) with a
    ``ShardReader`` built once; epochs are run on it with ``epoch()``, one at a time.

    ``context``: "spawn" or "forkserver" (never "fork": forking where Deep Lake or an event loop is live
    hangs or segfaults). ``timeout``: seconds each step of stopping the workers may take (ask, SIGTERM,
    SIGKILL), and how long an abandoned epoch may take to settle. ``sampler``: the parent's sampler for
    this shard when the caller has one already (``AsyncLoader``). ``options``: a ``LoaderOptions``, or the
    keyword arguments of one. ``transform`` and ``collate_fn`` must be picklable (module level).
    """

    def __init__(
        self,
        source: Source[Any],
        options: LoaderOptions | Mapping[str, Any],
        shard: Shard,
        processes: int,
        *,
        context: str = "spawn",
        timeout: float = 10.0,
        sampler: EpochSampler | None = None,
    ) -> None:
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
        if not isinstance(options, LoaderOptions):
            for key in ("shard", "processes"):
                if key in options:
                    raise ConfigError(f"loader_kwargs[{key!r}] is not allowed: the fan-out sets each worker's {key}")
            options = LoaderOptions(**options)
        # Workers read in order so that every message names its batch (see the module doc), and never
        # fan out again.
        options = _per_worker(options, processes)
        if sampler is None:  # the plan of this shard, as each worker computes its share of it
            sampler = ShardReader(source.open(), options, shard).sampler
        self.sampler = sampler
        self.processes = processes
        self.url = source.url
        self._context = context
        self._timeout = float(timeout)
        # A worker with no batch in any epoch (fewer batches than processes) is not worth a process.
        self._specs = [
            _WorkerSpec(k, source, options, sub_shard(shard, k, processes), _CREDITS)
            for k in range(min(processes, len(sampler)))
        ]  # fmt: skip
        try:
            ForkingPickler.dumps(self._specs[0] if self._specs else None)
        except Exception as exc:
            raise ConfigError(
                f"processes={processes} needs loader options that can be pickled into a new process "
                f"({type(exc).__name__}: {exc}); define transform and collate_fn at module level"
            ) from exc
        self.procs: dict[int, _Proc] = {}
        self._pids: dict[int, int] = {}
        self.gen = 0  # the latest epoch started on the pool
        self.busy: set[int] = set()  # workers that owe epoch ``gen`` its terminal message
        self._finalizer = on_exit(self, Stage.WORKERS, _stop_workers, self.procs, self._timeout, os.getpid())

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def pids(self) -> dict[int, int]:
        """Worker index → pid of the workers started (empty before the first epoch's ``next()``; kept after
        ``close()``, for logs and for checking that they are gone)."""
        return dict(self._pids)

    def epoch(
        self, epoch: int, *, skip: frozenset[int] = frozenset(), in_order: bool = True,
        progress: EpochProgress | None = None,
    ) -> FanoutEpoch:  # fmt: skip
        """An iterator over epoch ``epoch`` served by this pool (the workers start on its first ``next()``)."""
        return FanoutEpoch._on(self, epoch, skip=skip, in_order=in_order, progress=progress, owns_pool=False)

    def close(self) -> None:
        """Stop and join every worker (ask, SIGTERM, SIGKILL, ``timeout`` seconds apart); idempotent."""
        self.busy.clear()
        self._finalizer()

    def begin(self, epoch: int, skips: Mapping[int, frozenset[int]]) -> int:
        """Start the workers if they are not running, settle an epoch still open, and ask worker ``k`` of
        ``skips`` to serve ``epoch`` leaving out its own batches ``skips[k]``; returns the epoch's gen."""
        if self.closed:
            raise RuntimeError(f"asyncload: the fan-out pool for {self.url} is closed")
        self.settle(self.gen)
        if not self.procs:
            self._start()
        self.gen += 1
        for k, own_skip in skips.items():
            self.send(k, StartEpoch(self.gen, epoch, own_skip))
        self.busy = set(skips)
        return self.gen

    def send(self, k: int, msg: object) -> None:
        try:
            self.procs[k].conn.send(msg)
        except OSError:
            pass  # it is gone: the next wait sees its sentinel

    def settle(self, gen: int, stats: Stats | None = None) -> None:
        """End epoch ``gen`` if it is still open: cancel it in every worker that owes its terminal message
        and drop what they send until each has answered (the figures of an ``End`` go to ``stats``). A
        worker that dies or does not answer within ``2 * timeout`` closes the pool (the next epoch starts
        fresh workers): a worker sees the cancel once its next batch is ready, then closes its epoch, which
        waits up to ``timeout`` for its reads in flight."""
        if gen != self.gen or not self.busy or self.closed:
            return
        try:
            for k in self.busy:
                self.send(k, Cancel(gen))
            deadline = time.monotonic() + 2 * self._timeout
            while self.busy:
                conns = {self.procs[k].conn: k for k in self.busy}
                sentinels = {self.procs[k].process.sentinel: k for k in self.busy}
                ready = wait([*conns, *sentinels], timeout=max(0.0, deadline - time.monotonic()))
                if not ready or any(r in sentinels for r in ready):
                    log.warning(
                        "asyncload: fan-out workers %s for %s %s while settling an abandoned epoch; "
                        "restarting the pool at the next epoch", sorted(self._pids[k] for k in self.busy),
                        self.url, f"did not answer within {2 * self._timeout:.1f}s" if not ready else "died",
                    )  # fmt: skip
                    self.close()
                    return
                for r in ready:
                    try:
                        msg = self.procs[conns[r]].channel.recv()  # a dropped batch is mapped and freed here
                    except Exception:  # noqa: BLE001 - EOF: it is dying; its sentinel tells the rest
                        log.warning(
                            "asyncload: fan-out worker %d for %s broke its pipe while settling", conns[r], self.url
                        )
                        self.close()
                        return
                    if isinstance(msg, _TERMINAL) and msg.gen == gen:
                        self.busy.discard(conns[r])
                        if isinstance(msg, End) and stats is not None:
                            _add_figures(stats, msg.figures)
        except BaseException:
            self.close()  # a broken pipe, or Ctrl-C while settling: stop rather than guess
            raise

    def _start(self) -> None:
        ctx: Any = multiprocessing.get_context(self._context)  # SpawnContext or ForkServerContext
        # Workers inherit this process's multiprocessing temp dir (where the sockets that pass file
        # descriptors live) instead of making their own, which ``os._exit`` would leave behind.
        multiprocessing.util.get_temp_dir()
        for spec in self._specs:
            parent_end, child_end = ctx.Pipe(duplex=True)
            k = spec.index
            proc = ctx.Process(target=_worker_main, args=(child_end, spec), name=f"asyncload-fanout-{k}", daemon=True)
            try:
                proc.start()
            except BaseException:
                parent_end.close()
                raise
            finally:
                child_end.close()  # the worker holds its end now; ours would hide its EOF
            self.procs[k] = _Proc(k, proc, _Channel(parent_end))
            self._pids[k] = proc.pid  # type: ignore[assignment]


# -- in the parent: one epoch ----------------------------------------------------------------------
@dataclass
class _Turns:
    """One worker's share of one epoch, as the parent sees it."""

    index: int
    seqs: list[int]  # the parent sequence numbers this worker delivers, ascending (skips left out)
    next: int = 0  # position in ``seqs`` of the first batch not yet yielded
    pending: Batch | None = None  # a batch received ahead of its turn (in-order merge)
    ended: bool = False  # it sent End: its loader yielded every batch it will

    @property
    def owes(self) -> bool:
        return self.next < len(self.seqs)


@dataclass
class _Lease:
    """What ends an epoch (``FanoutEpoch``'s finaliser; it must not hold the epoch): settle it on a shared
    pool, or close a pool the epoch owns."""

    pool: WorkerPool
    owns_pool: bool
    stats: Stats
    gen: int | None = None  # set when the epoch starts

    def end(self) -> None:
        if self.gen is not None:
            self.pool.settle(self.gen, self.stats)
        if self.owns_pool:
            self.pool.close()


class FanoutEpoch(Epoch):
    """One epoch of ``source``'s ``shard`` read by ``processes`` worker processes; yields the batches one
    in-process ``AsyncLoader`` with the same options would (in the same order when ``in_order``).

    Built on its own it starts a private ``WorkerPool`` (see there for ``context`` and ``timeout``) and
    closes it at the end; ``WorkerPool.epoch()`` builds one on a persistent pool instead.
    ``skip``: sequence numbers of this epoch's batches already consumed (resume): parent batch ``j`` is
    batch ``j // K`` of worker ``j % K``, whose loader leaves it out unread.
    Use as an iterator and ``close()`` it, or as a context manager; ``break`` + garbage collection and
    interpreter exit also end it.
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
        pool = WorkerPool(source, loader_kwargs, shard, processes, context=context, timeout=timeout)
        self._setup(pool, epoch, skip=skip, in_order=in_order, progress=progress, owns_pool=True)

    @classmethod
    def _on(cls, pool: WorkerPool, epoch: int, **kw: Any) -> FanoutEpoch:
        self = cls.__new__(cls)
        self._setup(pool, epoch, **kw)
        return self

    def _setup(
        self, pool: WorkerPool, epoch: int, *, skip: frozenset[int], in_order: bool,
        progress: EpochProgress | None, owns_pool: bool,
    ) -> None:  # fmt: skip
        if any(not isinstance(j, int) or j < 0 for j in skip):
            if owns_pool:
                pool.close()
            raise ConfigError(f"skip={sorted(skip)!r} is not allowed: batch sequence numbers (ints >= 0)")
        self._pool = pool
        self._k = k = pool.processes
        self._batches: list[list[int]] = pool.sampler.batches(epoch)
        self._order = [j for j in range(len(self._batches)) if j not in skip]
        self._epoch = epoch
        self._turns: dict[int, _Turns] = {}
        self._skips: dict[int, frozenset[int]] = {}
        for w in range(k):
            seqs = [j for j in self._order if j % k == w]
            if seqs:  # a worker with nothing left in this epoch is not asked
                self._turns[w] = _Turns(w, seqs)
                self._skips[w] = frozenset(j // k for j in skip if j % k == w and j < len(self._batches))
        self._in_order = in_order
        self._pos = 0  # in_order: position in ``_order`` of the next batch to yield
        self._rotate = 0  # in_order=False: where the next search for a ready worker starts
        # The record of consumed batches (``AsyncLoader.state_dict`` reads it) and this epoch's figures
        # (``AsyncLoader.stats()`` reports them), the workers' added at the end.
        self._progress = progress if progress is not None else EpochProgress(epoch, len(self._batches), extra=set(skip))
        self._stats = Stats()
        self._closed = False
        self._lease = _Lease(pool, owns_pool, self._stats)
        self._finalizer = on_exit(self, Stage.WORK, self._lease.end)

    # -- what a caller sees ----------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches this epoch yields (skipped ones left out)."""
        return len(self._order)

    @property
    def pids(self) -> dict[int, int]:
        """Worker index → pid of the pool's workers (see ``WorkerPool.pids``)."""
        return self._pool.pids

    def __next__(self) -> Any:
        if self._closed or (self._lease.gen is not None and self._lease.gen != self._pool.gen):
            self.close()  # ended, or a newer epoch took the pool (which settled this one)
            raise StopIteration
        st = self._stats
        t0 = st.waiting_since = time.perf_counter()
        try:
            if self._lease.gen is None:
                st.started = t0
                self._lease.gen = self._pool.begin(self._epoch, self._skips)
            count, batch = self._next_in_order() if self._in_order else self._next_ready()
        except BaseException as exc:
            st.waiting_since = None
            if not isinstance(exc, Exception):  # Ctrl-C: stop the workers now rather than settle
                self._pool.close()
            self.close()
            raise
        now = time.perf_counter()
        st.wait_s += now - t0
        st.waiting_since = None
        if batch is END:
            self.close()
            raise StopIteration
        st.batches_yielded += 1
        st.samples_yielded += count
        if st.first_batch_s is None:
            st.first_batch_s = now - st.started
        return batch

    def close(self) -> None:
        """End the epoch: settle it on a shared pool (workers stay, idle), or close a pool it owns."""
        if self._closed:
            return
        self._closed = True
        self._stats.finished = time.perf_counter()
        self._finalizer()

    # -- receiving -------------------------------------------------------------------------------
    def _name(self, t: _Turns) -> str:
        pid = self._pool.pids.get(t.index)
        return f"fan-out worker {t.index} of {self._k} (pid {pid}) for {self._pool.url}"

    def _receive(self, wanted: list[_Turns]) -> tuple[_Turns, Batch | End | Failed]:
        """Block until one of ``wanted`` sends a message of this epoch; raise ``WorkerError`` as soon as any
        worker that still owes batches dies. Sleeps in ``wait`` on pipes and process sentinels: no polling.
        Messages of an earlier epoch are dropped."""
        for t in wanted:
            if t.pending is not None:
                msg, t.pending = t.pending, None
                return t, msg
        procs, gen = self._pool.procs, self._lease.gen
        while True:
            conns = {procs[t.index].conn: t for t in wanted}
            sentinels = {procs[t.index].process.sentinel: t for t in self._turns.values() if t.owes}
            ready = wait([*conns, *sentinels])
            readable = sorted((conns[r] for r in ready if r in conns), key=lambda t: (t.index - self._rotate) % self._k)
            for t in readable:
                try:
                    msg = procs[t.index].channel.recv()
                except Exception as exc:  # noqa: BLE001 - EOF, or the fds of a dead sender are gone
                    self._died(t, exc)
                if getattr(msg, "gen", None) != gen:
                    continue  # an abandoned epoch's: dropped (its shared memory freed with it)
                if isinstance(msg, _TERMINAL):
                    self._pool.busy.discard(t.index)  # the worker is idle again
                if isinstance(msg, End):
                    _add_figures(self._stats, msg.figures)
                if not isinstance(msg, Cancelled):
                    return t, msg
            for r in ready:
                if r in sentinels:
                    self._died(sentinels[r], None)

    def _died(self, t: _Turns, cause: BaseException | None) -> None:
        """Raise the ``WorkerError`` for ``t``'s worker, whose pipe broke or whose process ended; the pool
        is closed (the next epoch starts fresh workers)."""
        proc = self._pool.procs[t.index].process
        proc.join(1.0)  # its sentinel is ready or its pipe closed: this reaps it
        pid, exitcode, name = proc.pid, proc.exitcode, self._name(t)
        self._pool.close()
        if exitcode is None:  # alive, yet its message could not be read
            raise WorkerError(
                f"asyncload could not receive a batch from {name}: {type(cause).__name__}: {cause}"
            ) from cause
        held = [i for j in t.seqs[t.next :] for i in self._batches[j]]
        err = WorkerError(
            f"asyncload {name} {_how_it_ended(exitcode)} holding "
            f"{len(t.seqs) - t.next} undelivered batches of indices {_short(held)}"
        )
        err.worker, err.pid, err.exitcode, err.indices = t.index, pid, exitcode, held  # type: ignore[attr-defined]
        raise err from cause

    def _deliver(self, t: _Turns, msg: Batch | Failed) -> tuple[int, Any]:
        """``(samples, batch)`` of a ``Batch``; raises a worker's ``Failed``."""
        if isinstance(msg, Failed):
            raise msg.error.raise_in(self._name(t))
        at = msg.seq * self._k + t.index
        t.next = bisect.bisect_right(t.seqs, at)
        assert self._lease.gen is not None
        self._pool.send(t.index, Credit(self._lease.gen))
        self._progress.mark(at)
        return msg.count, msg.batch

    def _next_in_order(self) -> tuple[int, Any]:
        while self._pos < len(self._order):
            j = self._order[self._pos]
            t = self._turns[j % self._k]
            msg: Batch | End | Failed | None = None  # None: nothing for turn j
            if not t.ended:
                _, msg = self._receive([t])
            if isinstance(msg, Batch):
                at = msg.seq * self._k + t.index
                if at > j:  # batch j never came (on_error="skip" left all of it out): keep this one for its turn
                    t.pending, msg = msg, None
                elif at < j:
                    raise WorkerError(f"asyncload {self._name(t)} sent batch {at} after batch {j} (out of order)")
            self._pos += 1
            if isinstance(msg, (Batch, Failed)):
                return self._deliver(t, msg)
            self._progress.mark(j)  # batch j was left out whole (on_error="skip"): consumed
            t.ended = t.ended or isinstance(msg, End)  # it sends nothing more: its remaining turns are empty
            t.next = max(t.next, bisect.bisect_right(t.seqs, j))
        return 0, END

    def _next_ready(self) -> tuple[int, Any]:
        while True:
            owing = [t for t in self._turns.values() if t.owes]
            if not owing:
                return 0, END
            t, msg = self._receive(owing)
            self._rotate = t.index + 1
            if isinstance(msg, End):
                t.ended, t.next = True, len(t.seqs)
                continue
            return self._deliver(t, msg)


__all__ = ["FanoutEpoch", "WorkerPool", "sub_shard"]
