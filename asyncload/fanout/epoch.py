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
import concurrent.futures
import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from .._loop import Stage, on_exit, thread_pool
from .._procs import cause_of_death, how_it_ended
from .._protocol import END, Failure
from ..epoch import Epoch, report_skipped
from ..errors import ConfigError, ReaderCrashError, WorkerError, _short
from ..image.decode import Stage as DecodeStage
from ..image.gpu import PACKED, finish
from ..sampler import Shard
from ..sources.base import Source
from ..state import EpochProgress
from ..stats import Stats
from .pool import _Pool
from .wire import (
    _CREDITS,
    Batch,
    Cancelled,
    Credit,
    Done,
    End,
    Failed,
    ReadOne,
    StartEpoch,
    Terminal,
    _add_figures,
    _figures,
)

log = logging.getLogger("asyncload")


@dataclass
class _Turns:
    """One worker's share of one epoch, as the parent sees it."""

    index: int
    seqs: list[int]  # the parent sequence numbers this worker delivers, ascending (skips left out)
    next: int = 0  # position in ``seqs`` of the first batch not yet yielded
    pending: Batch | None = None  # a batch received ahead of its turn (in-order merge)
    ended: bool = False  # it sent End: its loader yielded every batch it will
    #: after its reader died: what the batches read alone gave, in order, before its stream resumes
    stash: deque[Batch | Failed | End] = field(default_factory=deque)
    settled: set[int] = field(default_factory=set)  # seqs the stash (or a left-out batch) answered
    uncredited: int = 0  # stash batches handed out: the new reader's stream never sent them

    @property
    def owes(self) -> bool:
        return self.next < len(self.seqs)


@dataclass(frozen=True)
class _Died:
    """A reader died while reading alone (``_FanoutEpoch._ask``): how it ended."""

    pid: int | None
    exitcode: int | None

    @property
    def how(self) -> str:
        return how_it_ended(self.exitcode)

    @property
    def signal(self) -> str:
        return cause_of_death(self.exitcode)


@dataclass
class _Taken:
    """A batch taken from the workers and not yet yielded. The progress marks it carries (its own seq, and
    the seqs left out whole before it) are recorded when it is yielded, not when it arrived, so that a state
    saved mid-epoch never counts a batch the consumer has not had. A failure is kept to raise at its turn."""

    count: int
    marks: list[int]
    batch: Any = None
    future: concurrent.futures.Future[tuple[Any, list[tuple[int, str]]]] | None = None  # on the device threads
    error: Exception | None = None

    @property
    def ready(self) -> bool:
        return self.future is None or self.future.done()


@dataclass
class _Lease:
    """What ends an epoch (``FanoutEpoch``'s finaliser; it must not hold the epoch): stop its device
    threads, settle it on a shared pool, or close a pool the epoch owns."""

    pool: WorkerPool
    owns_pool: bool
    stats: Stats
    gen: int | None = None  # set when the epoch starts
    device: concurrent.futures.ThreadPoolExecutor | None = None  # ``decode="cuda"``: ``_finish_ahead``

    def end(self) -> None:
        if self.device is not None:  # batches not begun are dropped; one being decoded is waited for
            self.device.shutdown(wait=True, cancel_futures=True)
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
        context: str = "forkserver",
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
        self._restarts = 0  # deaths this epoch that count against ``max_restarts``
        self._marks: list[int] = []  # seqs taken (delivered, or left out whole) since the last ``_take``
        self._ahead: deque[_Taken] = deque()  # ``decode="cuda"``: taken, on the device threads, not yet yielded
        self._drained = False  # the workers have nothing more for this epoch (or failed): take no more
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
            count, batch = self._next_batch()
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
            report_skipped(st, self._epoch, self._pool.url)
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
        self._ahead.clear()

    # -- handing over ----------------------------------------------------------------------------
    def _next_batch(self) -> tuple[int, Any]:
        """The next batch to yield, its progress marks recorded now. With a device stage (``decode="cuda"``)
        it is the oldest of the batches that ``_finish_ahead`` keeps finishing ahead of the consumer."""
        stage = self._pool.gpu_stage
        if stage is None:
            taken = self._take()
        else:
            self._finish_ahead(stage)
            taken = self._ahead.popleft()
        for j in taken.marks:
            self._progress.mark(j)
        if taken.error is not None:
            raise taken.error
        if taken.future is None:
            return taken.count, taken.batch
        batch, skipped = taken.future.result()
        self._stats.record_skipped(skipped)
        return taken.count - len(skipped), batch

    def _take(self) -> _Taken:
        """The next batch from the workers as they sent it, or the failure that ends the epoch there."""
        try:
            count, batch = self._next_in_order() if self._in_order else self._next_ready()
            taken = _Taken(count, self._marks, batch)
        except Exception as exc:  # noqa: BLE001 - raised at its turn (Ctrl-C is not kept: it goes now)
            taken = _Taken(0, self._marks, error=exc)
        self._marks = []
        return taken

    def _finish_ahead(self, stage: DecodeStage) -> None:
        """Keep the workers' packed batches finishing (``gpu.finish``: nvJPEG, masks, geometry) on a pool of
        device threads, as many as one process decodes with (``cpu_pool``), up to one more batch than threads
        ahead of the consumer. One receiving thread that finished each batch before taking the next held K
        workers below one process's rate. Takes from the workers until the window is full, the oldest batch
        is finished, or the epoch has nothing more; a worker's batch that is not packed passes as it is."""
        threads = self._pool.options.cpu_pool
        if self._lease.device is None:
            self._lease.device = thread_pool(threads, "asyncload-device")
        stage = stage.for_epoch(self._epoch)
        while not self._drained and len(self._ahead) <= threads and not (self._ahead and self._ahead[0].ready):
            taken = self._take()
            if taken.error is not None or taken.batch is END:
                self._drained = True
            elif isinstance(taken.batch, dict) and PACKED in taken.batch:
                taken.future = self._lease.device.submit(finish, stage, taken.batch, self._pool.with_index)
                taken.batch = None
            self._ahead.append(taken)

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
            if t.stash:
                stashed = t.stash.popleft()
                t.uncredited += isinstance(stashed, Batch)
                return t, stashed
        procs, gen = self._pool.procs, self._lease.gen
        while True:
            conns = {procs[t.index].conn: t for t in wanted}
            sentinels = {procs[t.index].process.sentinel: t for t in self._turns.values() if t.owes}
            ready = wait([*conns, *sentinels])
            readable = sorted((conns[r] for r in ready if r in conns), key=lambda t: (t.index - self._rotate) % self._k)
            dead = [sentinels[r] for r in ready if r in sentinels]
            for t in readable:
                try:
                    msg = procs[t.index].channel.recv()
                except Exception as exc:  # noqa: BLE001 - EOF, or the fds of a dead sender are gone
                    self._recover(t, exc)
                    return self._receive(wanted)
                if getattr(msg, "gen", None) != gen:
                    continue  # an abandoned epoch's: dropped (its shared memory freed with it)
                if isinstance(msg, Terminal):
                    self._pool.busy.discard(t.index)  # the worker is idle again
                if isinstance(msg, End):
                    _add_figures(self._stats, msg.figures)
                if not isinstance(msg, Cancelled):
                    return t, msg
            if dead:  # a ready sentinel: that process has ended
                self._recover(dead[0], None)
                return self._receive(wanted)

    # -- a reader that died ------------------------------------------------------------------------
    def _held(self, t: _Turns) -> list[int]:
        """The seqs ``t``'s reader owed and the parent has not received."""
        pending = None if t.pending is None else t.pending.seq * self._k + t.index
        return [j for j in t.seqs[t.next :] if j not in t.settled and j != pending]

    def _window(self) -> int:
        """The most batches a reader can have begun and not handed over: those it may send ahead (its
        credits), plus the batches its pipeline keeps alive (``Plan.slots`` at the most reads in flight)."""
        o = self._pool.options
        most = o.max_concurrency if o.concurrency == "auto" else int(o.concurrency)
        return _CREDITS + o.prefetch + math.ceil(most / o.batch_size) + 1

    def _recover(self, t: _Turns, cause: BaseException | None) -> None:
        """``t``'s reader died (or its pipe broke) owing batches: start a new one, read the batches it may
        have been reading one at a time (so that a batch that kills a reader again is known, and then its
        rows), and resume the stream for the rest. Counted in ``max_restarts``; past it, ``WorkerError``."""
        held = self._held(t)
        pid, exitcode = self._pool.reap(t.index)
        self._charge(t, _Died(pid, exitcode), held, cause)  # past the budget: raises, no new reader
        self._pool.restart(t.index)
        self._stats.worker_restarts += 1
        self._log_restart(t, _Died(pid, exitcode), held)
        gen = self._lease.gen
        assert gen is not None
        n = self._window()
        window, rest = held[:n], held[n:]
        for j in window:
            outcome = self._read_alone(t, j)
            t.settled.add(j)
            if outcome is not None:
                t.stash.append(outcome)
            if isinstance(outcome, Failed):
                return  # the epoch raises it at j: nothing after it is read
        if not rest:  # nothing left for a stream: say so as its End would
            t.stash.append(End(gen, _figures(Stats())))
            return
        mine = {j // self._k for j in range(len(self._batches)) if j % self._k == t.index}
        self._pool.send(t.index, StartEpoch(gen, self._epoch, frozenset(mine - {j // self._k for j in rest})))
        self._pool.busy.add(t.index)

    def _charge(self, t: _Turns, died: _Died, held: list[int], cause: BaseException | None) -> None:
        """Count a death against ``max_restarts``; past that, close the pool and raise ``WorkerError``
        naming the worker, how it ended and the rows it held."""
        self._restarts += 1
        budget = self._pool.options.max_restarts
        rows = [i for j in held for i in self._batches[j]]
        name = f"fan-out worker {t.index} of {self._k} (pid {died.pid}) for {self._pool.url}"
        if self._restarts > budget:
            self._pool.close()
            err = WorkerError(
                f"asyncload {name} {died.how} holding {len(held)} undelivered batches of indices {_short(rows)}"
                + (f", after {budget} restarts this epoch (max_restarts={budget})" if budget else "")
            )
            err.worker, err.pid, err.exitcode, err.indices = t.index, died.pid, died.exitcode, rows  # type: ignore[attr-defined]
            raise err from cause

    def _log_restart(self, t: _Turns, died: _Died, held: list[int]) -> None:
        """One warning per restart: who died, how, the rows it held, and who reads them now."""
        log.warning(
            "asyncload: fan-out worker %d of %d (pid %s) for %s %s holding %d batches (indices %s); a new reader "
            "(pid %s) reads them again (restart %d of %d this epoch)",
            t.index, self._k, died.pid, self._pool.url, died.how, len(held),
            _short([i for j in held for i in self._batches[j]], limit=1024), self._pool.pids.get(t.index),
            self._restarts, self._pool.options.max_restarts,
        )  # fmt: skip

    def _read_alone(self, t: _Turns, j: int) -> Batch | Failed | None:
        """Batch ``j`` read by ``t``'s new reader with nothing else in flight: its ``Batch``, its ``Failed``,
        or None when none of its samples is left. A read that kills the reader again is narrowed down to
        the rows that do (``_culprits``); those raise ``ReaderCrashError`` or, with ``on_error="skip"``,
        are left out and counted, and the rest is read again."""
        rows = list(self._batches[j])
        while True:
            outcome = self._ask(t, j, rows, probe=False)
            if not isinstance(outcome, _Died):
                return outcome
            bad = self._culprits(t, j, rows, outcome)
            if not bad:  # no part of it kills a reader alone: a crash that comes and goes (``_ask`` logged it)
                self._charge(t, outcome, [j], None)
                continue
            ids = self._pool.source.row_ids([r for r, _ in bad])
            if self._pool.options.on_error != "skip":
                sigs = sorted({d.signal for _, d in bad})
                err = ReaderCrashError(
                    f"reading {f'row {ids[0]}' if len(ids) == 1 else f'rows {_short(ids)}'} of {self._pool.url} killed its reader "
                    f"process ({', '.join(sigs)}) each time it was read, alone, in a new reader",
                    source=self._pool.url, indices=ids, signal=", ".join(sigs),
                )  # fmt: skip
                assert self._lease.gen is not None
                return Failed(self._lease.gen, Failure(err))
            reasons = [f"ReaderCrashError: reading it killed its reader process ({d.signal})" for _, d in bad]
            self._stats.record_skipped(list(zip(ids, reasons, strict=True)))
            gone = {r for r, _ in bad}
            rows = [r for r in rows if r not in gone]
            if not rows:
                return None

    def _culprits(self, t: _Turns, j: int, rows: list[int], died: _Died) -> list[tuple[int, _Died]]:
        """The rows among ``rows`` (whose read, alone, killed a reader: ``died``) whose read kills a reader,
        found by halves. Each death is one more new reader, not counted in ``max_restarts``: each halves
        what is suspect."""
        if len(rows) == 1:
            return [(rows[0], died)]
        found: list[tuple[int, _Died]] = []
        half = len(rows) // 2
        for part in (rows[:half], rows[half:]):
            outcome = self._ask(t, j, part, probe=True)
            if isinstance(outcome, _Died):
                found += self._culprits(t, j, part, outcome)
        return found

    def _ask(self, t: _Turns, j: int, rows: list[int], *, probe: bool) -> Batch | Failed | None | _Died:
        """Have ``t``'s reader read ``rows`` alone as batch ``j`` and wait for its answer: the ``Batch`` (None
        for a probe, or when every sample was skipped), its ``Failed``, or ``_Died`` when the read killed it
        (the reader is replaced, idle)."""
        pool, gen = self._pool, self._lease.gen
        assert gen is not None
        pool.send(t.index, ReadOne(gen, self._epoch, j // self._k, tuple(rows), probe))
        pool.busy.add(t.index)
        got: Batch | None = None
        while True:
            proc = pool.procs[t.index]
            ready = wait([proc.conn, proc.process.sentinel])
            try:
                msg = proc.channel.recv() if proc.conn in ready else None
            except Exception:  # noqa: BLE001 - EOF: it died; its sentinel says how
                msg = None
            if msg is None:
                if proc.process.exitcode is None and proc.conn in ready:
                    continue  # its pipe is readable but the process lives: read on (the kill comes next)
                pid, exitcode = pool.replace(t.index)
                self._stats.worker_restarts += 1
                died = _Died(pid, exitcode)
                log.warning(
                    "asyncload: a reader of %s %s reading indices %s of batch %d alone; a new reader (pid %s) "
                    "continues", pool.url, died.how, _short(rows), j, pool.pids.get(t.index),
                )  # fmt: skip
                return died
            if getattr(msg, "gen", None) != gen:
                continue
            if isinstance(msg, Batch):
                got = msg
            elif isinstance(msg, Done):
                pool.busy.discard(t.index)
                if not probe:
                    _add_figures(self._stats, msg.figures)
                return got
            elif isinstance(msg, Failed):
                pool.busy.discard(t.index)
                return None if probe else msg
            elif isinstance(msg, Terminal):  # Cancelled: not asked for; nothing came
                pool.busy.discard(t.index)
                return None

    def _deliver(self, t: _Turns, msg: Batch | Failed) -> tuple[int, Any]:
        """``(samples, batch)`` of a ``Batch``; raises a worker's ``Failed``."""
        if isinstance(msg, Failed):
            raise msg.error.raise_in(self._name(t))
        at = msg.seq * self._k + t.index
        t.next = bisect.bisect_right(t.seqs, at)
        assert self._lease.gen is not None
        if t.uncredited:  # a batch read alone after a restart: the new reader's stream did not send it
            t.uncredited -= 1
        else:
            self._pool.send(t.index, Credit(self._lease.gen))
        self._marks.append(at)
        self._stats.batches_ready += 1  # received: ``ready_batches`` is what was received and not yet yielded
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
            self._marks.append(j)  # batch j was left out whole (on_error="skip"): consumed
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
