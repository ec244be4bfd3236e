"""One epoch as the parent reads it from the workers, and ``WorkerPool``, the pool that runs epochs.

Parent batch ``j`` is batch ``j // K`` of worker ``j % K`` (see the package doc). In order, the parent
reads the worker whose turn it is; ``in_order=False`` takes whichever worker's batch is ready first.
Workers always run their own loader in order, so the parent knows which batch every message is: a batch
left out whole (``on_error="skip"``) keeps its place, and a worker that dies is reported with the exact
dataset indices of the batches it had not delivered.

An exception in a worker is re-raised here with its type, its message and a note naming the worker and
carrying its traceback (at its place in the order when ``in_order``); the workers stay usable. A worker
that dies (SIGKILL, SIGSEGV on a corrupt chunk, SIGFPE on an empty one...) ends the epoch with
``WorkerError`` and closes the pool.

``WorkerPool`` lives here rather than in ``fanout.pool``: ``FanoutEpoch(source, ...)`` makes a private pool
and ``WorkerPool.epoch()`` makes an epoch, and one module holding both keeps the import graph one-way.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from .._loop import Stage, on_exit
from .._protocol import END
from ..epoch import Epoch
from ..errors import ConfigError, WorkerError, _short
from ..image.gpu import PACKED, finish
from ..sampler import Shard
from ..sources.base import Source
from ..state import EpochProgress
from ..stats import Stats
from .pool import _how_it_ended, _Pool
from .wire import Batch, Cancelled, Credit, End, Failed, Terminal, _add_figures


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
                if isinstance(msg, Terminal):
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
        stage = self._pool.gpu_stage
        if stage is not None and isinstance(msg.batch, dict) and PACKED in msg.batch:
            batch, skipped = finish(stage.for_epoch(self._epoch), msg.batch, self._pool.with_index)
            self._stats.record_skipped(skipped)
            return msg.count - len(skipped), batch
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


class WorkerPool(_Pool):
    """``processes`` persistent worker processes, each reading its sub-shard (``sub_shard``) with a
    ``ShardReader`` built once; epochs are run on it with ``epoch()``, one at a time.

    ``context``: "spawn" or "forkserver" (never "fork": forking where Deep Lake or an event loop is live
    hangs or segfaults). ``timeout``: seconds each step of stopping the workers may take (ask, SIGTERM,
    SIGKILL), and how long an abandoned epoch may take to settle. ``sampler``: the parent's sampler for
    this shard when the caller has one already (``AsyncLoader``). ``options``: a ``LoaderOptions``, or the
    keyword arguments of one. ``transform`` and ``collate_fn`` must be picklable (module level).
    """

    def epoch(
        self, epoch: int, *, skip: frozenset[int] = frozenset(), in_order: bool = True,
        progress: EpochProgress | None = None,
    ) -> FanoutEpoch:  # fmt: skip
        """An iterator over epoch ``epoch`` served by this pool (the workers start on its first ``next()``)."""
        return FanoutEpoch._on(self, epoch, skip=skip, in_order=in_order, progress=progress, owns_pool=False)
