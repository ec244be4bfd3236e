"""One epoch as the parent reads it from the workers of a ``WorkerPool``.

Parent batch ``j`` is batch ``j // K`` of worker ``j % K`` (see the package doc). In order, the parent
reads the worker whose turn it is; ``in_order=False`` takes whichever worker's batch is ready first.
Workers always run their own loader in order, so the parent knows which batch every message is: a batch
left out whole (``on_error="skip"``) keeps its place, and a worker that dies is reported with the exact
dataset indices of the batches it had not delivered.

An exception in a worker is re-raised here with its type, its message and a note naming the worker and
carrying its traceback (at its place in the order when ``in_order``); the workers stay usable. A worker
that dies (SIGKILL, SIGSEGV on a corrupt chunk, SIGFPE on an empty one...) or stops answering (its beats,
``wire.Beat``, say its reads have had no answer past the limit: stuck in a read of a silent store) is
replaced, as ``recovery`` decides: after a death, the batches it may have been reading are read again
alone and narrowed down to the rows that kill a reader; after a stall, its stream starts again where it
was. Past ``max_restarts`` deaths, or one outage past ``stall_timeout``, the epoch ends with
``WorkerError`` or ``StallError`` and the pool is closed. ``close()`` from another thread while the
consumer waits in ``next()`` wakes it with ``LoaderClosedError`` and stops the workers at once.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import dataclasses
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

from ...engine.epoch import Epoch, closed_error, report_skipped
from ...engine.progress import EpochProgress
from ...engine.protocol import END, Failure
from ...engine.sampler import Ranges
from ...engine.stats import Stats
from ...errors import ConfigError, LoaderClosedError, ReaderCrashError, StallError, WorkerError
from ...image.decode import DecodeStage
from ...image.gpu import PACKED, finish
from ...runtime.loop import ExitOrder, on_exit, thread_pool
from ..recovery import Ended, Recovery, beat_interval, drive
from .pool import WorkerPool
from .wire import (
    _CREDITS,
    Batch,
    Beat,
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
    #: when the parent last heard from it, or gave it reason to speak (a credit, a command): ``time.monotonic()``
    heard: float = field(default_factory=time.monotonic)
    silent_since: float | None = None  # its last ``Beat``: its reads have had no answer since then

    @property
    def owes(self) -> bool:
        return self.next < len(self.seqs)


#: Seconds past the policy's limit that a worker may send nothing at all, not even a beat, before it is
#: taken for stuck (a process that cannot run its beat thread: stopped, or a native call holding the GIL).
_FROZEN_ALLOWANCE = 30.0


class _Interrupted(BaseException):
    """``close()`` from another thread woke the consumer waiting for the workers (never leaves here)."""


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
    """What ends an epoch (``FanoutIterator``'s finaliser; it must not hold the epoch): stop its device
    threads and settle it on the pool."""

    pool: WorkerPool
    stats: Stats
    gen: int | None = None  # set when the epoch starts
    device: concurrent.futures.ThreadPoolExecutor | None = None  # ``decode="cuda"``: ``_finish_ahead``

    wake: tuple[int, int] | None = None  # a pipe that ``close()`` from another thread writes to
    kill: bool = False  # stop the workers rather than settle (Ctrl-C, close() during a wait, a stall)

    def end(self) -> None:
        if self.device is not None:  # batches not begun are dropped; one being decoded is waited for
            self.device.shutdown(wait=True, cancel_futures=True)
        if self.kill:
            self.pool.close(at_once=True)  # they hold nothing of the user's: killed now, not waited for
        if self.gen is not None:
            self.pool.settle(self.gen, self.stats)
        if self.wake is not None:
            for fd in self.wake:
                os.close(fd)
            self.wake = None


class FanoutIterator(Epoch):
    """Epoch ``epoch`` of ``pool``'s shard read by its worker processes; yields the batches one in-process
    ``AsyncLoader`` with the same options would (in the same order when ``in_order``). The pool's workers
    start on the first ``next()``; a newer epoch on the same pool settles this one.
    ``skip``: sequence numbers of this epoch's batches already consumed (resume): parent batch ``j`` is
    batch ``j // K`` of worker ``j % K``, whose loader leaves it out unread.
    Use as an iterator and ``close()`` it, or as a context manager; ``break`` + garbage collection and
    interpreter exit also end it.
    """

    def __init__(
        self, pool: WorkerPool, epoch: int, *, skip: frozenset[int] = frozenset(), in_order: bool = True,
        progress: EpochProgress | None = None, taken: Ranges = (),
    ) -> None:  # fmt: skip
        if any(not isinstance(j, int) or j < 0 for j in skip):
            raise ConfigError(f"skip={sorted(skip)!r} is not allowed: batch sequence numbers (ints >= 0)")
        self._pool = pool
        self._k = k = pool.processes
        self._taken = taken  # the positions an earlier world consumed (a resumed world): out of the cut
        self._batches: list[list[int]] = dataclasses.replace(pool.sampler, taken=taken).batches(epoch)
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
        o = pool.options
        self._policy = Recovery(pool.url, max_restarts=o.max_restarts, stall_timeout=o.stall_timeout, stats=self._stats)
        self._tick = beat_interval(o.stall_timeout)
        self._ended = False  # every batch was yielded (StopIteration), as opposed to stopped
        self._consumer: int | None = None  # the thread inside ``__next__``, if any
        self._left = threading.Event()  # set when no thread is inside ``__next__``
        self._left.set()
        self._interrupted = False  # ``close()`` from another thread stopped the wait
        self._marks: list[int] = []  # seqs taken (delivered, or left out whole) since the last ``_take``
        self._ahead: deque[_Taken] = deque()  # ``decode="cuda"``: taken, on the device threads, not yet yielded
        self._drained = False  # the workers have nothing more for this epoch (or failed): take no more
        self._lease = _Lease(pool, self._stats, wake=os.pipe())
        self._finalizer = on_exit(self, ExitOrder.WORK, self._lease.end)

    # -- what a caller sees ----------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches this epoch yields (skipped ones left out)."""
        return len(self._order)

    def __next__(self) -> Any:
        if self._closed or (self._lease.gen is not None and self._lease.gen != self._pool.gen):
            self.close()  # ended, or a newer epoch took the pool (which settled this one)
            if self._ended:
                raise StopIteration
            raise self._closed_error()
        st = self._stats
        t0 = self._waiting()
        self._consumer = threading.get_ident()
        self._left.clear()
        try:
            if self._lease.gen is None:
                st.started = t0
                self._lease.gen = self._pool.begin(self._epoch, self._skips, self._taken)
            count, batch = self._next_batch()
        except BaseException as exc:
            st.waiting_since = None
            if isinstance(exc, _Interrupted) or not isinstance(exc, Exception) or isinstance(exc, StallError):
                # Ctrl-C, close() from another thread, a store that never answered: stop the workers now
                # rather than settle (a worker stuck in a read would hold the settle for its timeout).
                self._lease.kill = True
            self._leave()
            self.close()
            if isinstance(exc, _Interrupted):
                raise self._closed_error() from None
            raise
        self._leave()
        if batch is END:
            self._waited(t0)
            self._ended = True
            self.close()
            report_skipped(st, self._epoch, self._pool.url)
            self._finished()
            raise StopIteration
        self._waited(t0, count)
        return batch

    def _leave(self) -> None:
        self._consumer = None
        self._left.set()

    def _closed_error(self) -> LoaderClosedError:
        return closed_error(self._pool.url, self._stats.batches_yielded, len(self._order))

    def close(self) -> None:
        """End the epoch: settle it on the pool (its workers stay, idle, for the next). From
        another thread while the consumer waits in ``next()``: the consumer is woken, gets
        ``LoaderClosedError``, and the workers are stopped at once (they may be stuck in a read)."""
        if self._closed:
            return
        if self._consumer is not None and self._consumer != threading.get_ident():
            self._interrupted = True
            wake = self._lease.wake
            if wake is not None:
                try:
                    os.write(wake[1], b"x")
                except OSError:
                    pass
            # The consumer ends the epoch itself (it owns the pipes it reads); wait for it, bounded.
            if self._left.wait(self._pool._timeout):
                return
            self._lease.kill = True  # it did not leave: stop the workers under it (their pipes close)
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
    def _name(self, t: _Turns, pid: int | None = None) -> str:
        pid = self._pool.pids.get(t.index) if pid is None else pid
        return f"fan-out worker {t.index} of {self._k} (pid {pid}) for {self._pool.url}"

    def _heard(self, t: _Turns, msg: object) -> bool:
        """Note a message from ``t``; True when it is a ``Beat`` (nothing more to do with it)."""
        t.heard = time.monotonic()
        if isinstance(msg, Beat):
            t.silent_since = msg.silent_since
            if msg.silent_since is not None:  # the one outage clock: counted and warned about here, once
                self._policy.silence(msg.silent_since, t.heard)
            return True
        t.silent_since = None
        if isinstance(msg, Batch):  # data: the store answered (a replacement's first words, a worker's end
            self._policy.answered(t.heard)  # or a cancel are not, and must not end an outage in progress)
        return False

    def _wait(self, objects: list[Any]) -> list[Any]:
        """``multiprocessing.connection.wait`` for ``objects`` or the wake pipe, at most a tick (what the
        caller then does with a silence is ``_watch``); ``_Interrupted`` when ``close()`` was called from
        another thread."""
        wake = self._lease.wake
        ready = wait([*objects, *([wake[0]] if wake is not None else [])], timeout=self._tick)
        if self._interrupted:
            raise _Interrupted
        return ready

    def _stuck(self, t: _Turns) -> float | None:
        """Since when ``t`` has left its reads unanswered, if that makes it stuck now (``recovery``): its
        beats say its reads have been silent past the policy's limit, or it has said nothing at all (not
        even a beat) for longer still. None: it is working."""
        now = time.monotonic()
        if t.silent_since is not None and self._policy.stuck(max(t.silent_since, 0.0), now):
            return t.silent_since
        if now - t.heard >= self._policy.limit(t.heard) + _FROZEN_ALLOWANCE:
            return t.heard
        return None

    def _receive(self, wanted: list[_Turns]) -> tuple[_Turns, Batch | End | Failed]:
        """Block until one of ``wanted`` sends a message of this epoch; recover a worker that dies or
        stops answering (``_recover``). Sleeps in ``wait`` on pipes and process sentinels, waking each tick
        to look for a stuck worker. Messages of an earlier epoch are dropped."""
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
            ready = self._wait([*conns, *sentinels])
            readable = sorted((conns[r] for r in ready if r in conns), key=lambda t: (t.index - self._rotate) % self._k)
            dead = [sentinels[r] for r in ready if r in sentinels]
            for t in readable:
                try:
                    msg = procs[t.index].channel.recv()
                except Exception as exc:  # noqa: BLE001 - EOF, or the fds of a dead sender are gone
                    self._recover(t, exc)
                    return self._receive(wanted)
                if self._heard(t, msg) or getattr(msg, "gen", None) != gen:
                    continue  # a beat; or an abandoned epoch's message: dropped (its shared memory freed with it)
                if isinstance(msg, Terminal):
                    self._pool.busy.discard(t.index)  # the worker is idle again
                if isinstance(msg, End):
                    _add_figures(self._stats, msg.figures)
                if not isinstance(msg, Cancelled):
                    return t, msg
            if dead:  # a ready sentinel: that process has ended
                self._recover(dead[0], None)
                return self._receive(wanted)
            for t in wanted:  # each wake, not only silent ones: a stuck worker's beats keep its pipe readable
                since = self._stuck(t)
                if since is not None:
                    self._recover(t, None, stuck_since=since)
                    return self._receive(wanted)

    # -- a reader that died or stopped answering ------------------------------------------------------
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

    def _replace(self, t: _Turns, stuck_since: float | None, held_rows: list[int], what: str) -> Ended:
        """End ``t``'s worker (killed first if it is ``stuck``), decide with the policy (``recovery``) and
        start its replacement, idle; how the old one ended. Raises the error that ends the epoch instead
        (the pool closed): a death past ``max_restarts``, a stall past ``stall_timeout``."""
        now = time.monotonic()
        if stuck_since is not None:
            self._pool.procs[t.index].process.kill()
        pid, exitcode = self._pool.reap(t.index)
        name = self._name(t, pid)
        policy = self._policy
        error: WorkerError | StallError | None
        if stuck_since is not None:
            ended = Ended(pid, exitcode, stalled=True, silent_s=now - stuck_since)
            error = policy.stalled(stuck_since, held_rows, now)
        else:
            ended = Ended(pid, exitcode)
            error = policy.charge(name, ended, held_rows, what) if what else None
        if error is not None:
            self._pool.close(at_once=True)
            if isinstance(error, WorkerError):
                error.worker = t.index  # type: ignore[attr-defined]
            raise error
        self._pool.restart(t.index)
        t.heard, t.silent_since = time.monotonic(), None
        self._stats.worker_restarts += 1
        return ended

    def _recover(self, t: _Turns, cause: BaseException | None, *, stuck_since: float | None = None) -> None:
        """``t``'s reader died (or its pipe broke, or it stopped answering: ``stuck_since``) owing batches:
        start a new one. After a death, the batches it may have been reading are read one at a time (so
        that a batch that kills a reader again is known, and then its rows); after a stall they are not (a
        stall is the store's, not a row's). Then its stream resumes for the rest."""
        held = self._held(t)
        # What it owes; for a stall, what it may have had in flight (a StallError names the rows in flight).
        named = held if stuck_since is None else held[: self._window()]
        rows = [i for j in named for i in self._batches[j]]
        try:
            ended = self._replace(t, stuck_since, rows, f"{len(held)} undelivered batches of indices")
        except WorkerError as err:
            raise err from cause
        self._policy.log_restart(self._name(t, ended.pid), ended, rows, f"{len(named)} batches (indices)",
                                 self._pool.pids.get(t.index), charged=True)  # fmt: skip
        gen = self._lease.gen
        assert gen is not None
        n = 0 if ended.stalled else self._window()
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
        self._pool.send(
            t.index, StartEpoch(gen, self._epoch, frozenset(mine - {j // self._k for j in rest}), self._taken)
        )
        self._pool.busy.add(t.index)
        t.heard = time.monotonic()

    def _read_alone(self, t: _Turns, j: int) -> Batch | Failed | None:
        """Batch ``j`` read by ``t``'s new reader with nothing else in flight: its ``Batch``, its ``Failed``,
        or None when none of its samples is left. What a read that kills the reader again costs, and which
        rows are named (``ReaderCrashError``, raised at ``j``'s turn) or left out: ``Recovery.read_alone``."""
        steps = self._policy.read_alone(
            list(self._batches[j]), name=lambda pid: self._name(t, pid), held="1 batch of indices",
            row_ids=self._pool.source.row_ids, skip=self._pool.options.on_error == "skip",
        )  # fmt: skip
        try:
            return drive(steps, lambda ask: self._ask(t, j, ask.rows, probe=ask.probe))  # type: ignore[no-any-return]
        except ReaderCrashError as err:
            assert self._lease.gen is not None
            return Failed(self._lease.gen, Failure(err))
        except WorkerError:
            self._pool.close(at_once=True)
            raise

    def _ask(self, t: _Turns, j: int, rows: list[int], *, probe: bool) -> Batch | Failed | None | Ended:
        """Have ``t``'s reader read ``rows`` alone as batch ``j`` and wait for its answer: the ``Batch`` (None
        for a probe, or when every sample was skipped), its ``Failed``, or how the reader ended when the read
        killed it (the reader is replaced, idle). A reader stuck in the read is replaced and asked again."""
        pool, gen = self._pool, self._lease.gen
        assert gen is not None
        pool.send(t.index, ReadOne(gen, self._epoch, j // self._k, tuple(rows), probe))
        pool.busy.add(t.index)
        t.heard, t.silent_since = time.monotonic(), None
        got: Batch | None = None
        while True:
            proc = pool.procs[t.index]
            ready = self._wait([proc.conn, proc.process.sentinel])
            since = self._stuck(t)  # (its beats keep the pipe readable: looked at whatever woke the wait)
            if since is not None:
                ended = self._replace(t, since, rows, "")
                self._policy.log_restart(self._name(t, ended.pid), ended, rows, f"batch {j} (indices)",
                                         pool.pids.get(t.index), charged=True)  # fmt: skip
                return self._ask(t, j, rows, probe=probe)
            if not ready:
                continue
            try:
                msg = proc.channel.recv() if proc.conn in ready else None
            except Exception:  # noqa: BLE001 - EOF: it died; its sentinel says how
                msg = None
            if msg is None:
                if proc.process.exitcode is None and proc.conn in ready:
                    continue  # its pipe is readable but the process lives: read on (the kill comes next)
                ended = self._replace(t, None, rows, "")  # narrowing: not charged (each halves what is left)
                log.warning(
                    "asyncload: a reader of %s %s reading indices %s of batch %d alone; a new reader (pid %s) "
                    "continues", pool.url, ended.how, rows if len(rows) <= 16 else f"{rows[:16]}...", j,
                    pool.pids.get(t.index),
                )  # fmt: skip
                return ended
            if self._heard(t, msg) or getattr(msg, "gen", None) != gen:
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
            t.heard = max(t.heard, time.monotonic())  # it may speak again: its silence counts from now
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
