"""What runs inside a worker process: build the loader once, then serve epochs as the parent asks.

Three threads: the main thread runs the epoch (its own ``ShardEpochs``: event loop, CPU pool, store
handle) and sends each batch against a credit; a control thread reads the parent's messages, so that
credits and cancels arrive while the main thread waits, and an epoch can be cancelled at its next credit
wait; a beat thread tells the parent, while the worker works, since when its reads have had no answer
(``wire.Beat``): a worker stuck in a read of a silent store is killed and replaced by the parent
(``recovery``), one that is only busy is not.

Batches are allocated in shared memory from the start (``wire._shared_empty``), so sending one copies
nothing. Ctrl-C is ignored: it reaches the whole process group, and the parent decides when its workers
stop. A worker exits only when told to (or when the parent is gone); it leaves with ``os._exit`` after
closing its loader, skipping an interpreter teardown that costs ~0.5 s and, with Deep Lake 4.7.4,
sometimes aborts.

The parent starts ``_worker_main`` by reference (spawn or forkserver): it must stay a module-level name
of this module.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from ...engine.options import LoaderOptions
from ...engine.progress import EpochProgress
from ...engine.protocol import Failure
from ...engine.sampler import Shard
from ...engine.shard import ShardEpochs
from ...engine.stats import Stats
from ...runtime.alloc import set_allocator
from ...runtime.loop import start_thread
from ...runtime.procs import run_child
from ...sources.base import Source
from ..recovery import beat_interval
from .wire import (
    _STOP,
    Batch,
    Beat,
    Cancel,
    Cancelled,
    Credit,
    Done,
    End,
    Failed,
    ReadOne,
    StartEpoch,
    Terminal,
    _Channel,
    _figures,
    _shared_empty,
)


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
    control thread (messages from the parent), waited on by the main thread before each send; read by the
    beat thread (``_beat``): what the worker is doing, and the figures of the reads it has in flight."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._gen = -1
        self._credits = 0
        self._cancelled = -1  # every epoch up to this gen is cancelled (gens only grow)
        self._stopped = False
        self.waiting = False  # the main thread waits for a credit: the parent owes it one, nothing to say
        self.busy = False  # a command is in progress
        self.opening_since: float | None = None  # the store is being opened (``time.monotonic()``)
        self.stats: Stats | None = None  # the figures of the command's pipeline, while it runs

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
            self.waiting = True
            try:
                self._cond.wait_for(lambda: self._over(gen) or self._credits > 0)
            finally:
                self.waiting = False
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

    def pause(self, seconds: float) -> bool:
        """Sleep ``seconds`` (the beat thread); True once the worker is stopping."""
        with self._cond:
            return self._cond.wait_for(lambda: self._stopped, seconds)


def _beat(channel: _Channel, ctl: _Control, every: float) -> None:
    """The worker's beat thread: every ``every`` seconds while a command is in progress (and the worker is
    not waiting for a credit, which the parent owes it) or while the store is being opened, tell the parent
    since when its reads have had no answer (``Beat``): progress is an answered or a new read, or nothing
    in flight. The parent kills a worker whose reads have been silent past the policy's limit."""
    last: tuple[int, int, int] | None = None
    progress_at = time.monotonic()
    while not ctl.pause(every):
        now = time.monotonic()
        st = ctl.stats
        silent: float | None
        if ctl.opening_since is not None:
            silent = ctl.opening_since
        elif not ctl.busy or ctl.waiting:
            last = None
            continue
        elif st is None or not st.in_flight:
            last, progress_at, silent = None, now, None
        elif (key := (st.samples_read, st.requests, st.skipped)) != last:
            last, progress_at, silent = key, now, None
        else:
            silent = progress_at
        try:
            channel.send(Beat(ctl._gen, silent))
        except OSError:
            return


def _listen(conn: Connection, ctl: _Control, commands: queue.SimpleQueue[StartEpoch | ReadOne | None]) -> None:
    """Worker's control thread: epochs to the main thread, credits and cancels to ``ctl``; stop on
    ``_STOP`` or when the parent is gone."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            msg = _STOP
        if isinstance(msg, (StartEpoch, ReadOne)):
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


def _run_epoch(channel: _Channel, shard: ShardEpochs, ctl: _Control, cmd: StartEpoch) -> End | Cancelled:
    """Serve one epoch of this worker's sub-shard, one batch per credit."""
    total = len(dataclasses.replace(shard.sampler, taken=cmd.taken))
    progress = EpochProgress(cmd.epoch, total)
    for j in cmd.skip:  # resume: these batches are left out without being read
        progress.mark(j)
    # Which batch each one yielded is: the epoch marks every batch it consumed in its progress,
    # including a wholly skipped one (on_error="skip") that it never yields; it yields in order.
    expected = collections.deque(s for s in range(total) if s not in cmd.skip)
    samples = 0
    with shard.iterate(cmd.epoch, progress, taken=cmd.taken) as it:
        ctl.stats = it.stats()
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


def _read_one(channel: _Channel, shard: ShardEpochs, ctl: _Control, cmd: ReadOne) -> Done | Cancelled:
    """Read ``cmd.indices`` alone as batch ``cmd.seq``: send it (unless a probe), then ``Done``. A probe's
    failure is an answer too (the read did not kill this process), so it ends in ``Done`` as well."""
    it = shard.iterate(cmd.epoch, EpochProgress(cmd.epoch, len(shard.sampler)), only=[(cmd.seq, list(cmd.indices))])
    ctl.stats = it.stats()
    try:
        with it:
            for batch in it:
                if cmd.probe:
                    continue
                if not ctl.take(cmd.gen):
                    return Cancelled(cmd.gen)
                _send(channel, Batch(cmd.gen, cmd.seq, it.stats().samples_yielded, batch))
                del batch
    except Exception:
        if not cmd.probe:
            raise
    return Done(cmd.gen, cmd.seq, _figures(it.stats()))


class _ParentSaysStalls(logging.Filter):
    """In a worker, the pipeline's own words about a stall (the warning once silent a while, the line when
    the store answers again) are left to the parent, which hears every worker's silence in its beats and
    says each outage once for all of them (``recovery.Recovery.silence``): K workers and the parent would
    otherwise each warn about the same outage. The ``StallError`` that ends an epoch still travels."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.module == "pipeline" and record.funcName in ("_watchdog", "_stall_ended"))


def _serve(conn: Connection, spec: _WorkerSpec) -> None:
    """Build this worker's loader once, then serve epochs as they are asked for until told to stop."""
    import torch.multiprocessing as torch_mp  # registers torch's reductions with ForkingPickler

    logging.getLogger("asyncload").addFilter(_ParentSaysStalls())

    torch_mp.set_sharing_strategy("file_descriptor")
    set_allocator(_shared_empty)
    # As in DataLoader workers: K processes each running torch ops on every core would oversubscribe.
    torch.set_num_threads(1)
    ctl, commands = _Control(), queue.SimpleQueue[StartEpoch | ReadOne | None]()
    start_thread(_listen, conn, ctl, commands, name="asyncload-fanout-control")
    channel = _Channel(conn)
    ctl.opening_since = time.monotonic()  # an open of a silent store is a stall too
    start_thread(_beat, channel, ctl, beat_interval(spec.options.stall_timeout), name="asyncload-fanout-beat")
    shard: ShardEpochs | None = None
    broken: Failure | None = None
    try:
        shard = ShardEpochs(spec.source.open(), spec.options, spec.shard, worker=True)
    except BaseException as exc:  # noqa: BLE001 - told to the parent at each epoch it asks for
        broken = Failure(exc)
    ctl.opening_since = None
    try:
        while (cmd := commands.get()) is not _STOP:
            ctl.busy, ctl.stats = True, None
            outcome: Terminal
            if shard is None:
                assert broken is not None
                outcome = Failed(cmd.gen, broken)
            elif not ctl.begin(cmd.gen, spec.credits):
                outcome = Cancelled(cmd.gen)
            else:
                try:
                    if isinstance(cmd, ReadOne):
                        outcome = _read_one(channel, shard, ctl, cmd)
                    else:
                        outcome = _run_epoch(channel, shard, ctl, cmd)
                except _ParentGone:
                    return
                except BaseException as exc:  # noqa: BLE001 - every failure is the parent's to raise
                    outcome = Failed(cmd.gen, Failure(exc))
            ctl.busy, ctl.stats = False, None
            _send(channel, outcome)
    except _ParentGone:
        return


def _worker_main(conn: Connection, spec: _WorkerSpec, environ: dict[str, str]) -> None:
    """Entry point of a worker process; ``environ``: the parent's environment when it started this one."""
    run_child(environ, _serve, conn, spec)
