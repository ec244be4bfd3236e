"""The worker processes as the parent holds them: started once, asked for epochs, stopped in steps.

One epoch at a time: ``begin`` settles the previous epoch if it is still open, then asks every worker for
its share of the next. An epoch abandoned mid-way (``break``, ``close()``, garbage collection, an
exception raised by a worker) is settled before the pool serves another: the parent sends ``Cancel`` to
every worker still busy with it and reads (and drops) their messages until each has answered with its
terminal message. A worker sees the cancel at its next credit wait, closes its epoch's iterator (reads in
flight awaited) and goes idle. Dropped batches are unpickled, which releases their shared memory. A worker
that does not answer within ``2 * timeout`` seconds, or dies, closes the whole pool: the next epoch starts
fresh workers.

Stopping (``close()``, garbage collection of the pool, interpreter exit at ``runtime.loop.ExitOrder.WORKERS``: after
epochs stopped and before multiprocessing's own hook) asks every worker to exit, kills the ones still
alive half a second later (a worker holds nothing of the user's, and one stuck in a read of a silent store
would never exit), and joins them all. A worker found waiting for its store while settling is not waited
for either: the pool is closed.

An epoch is read from the pool by ``processes.fanout.iterator.FanoutIterator(pool, epoch)``: the iterator
knows the pool, the pool knows nothing of iterators, so the import runs one way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ...engine.options import LoaderOptions
from ...engine.sampler import EpochSampler, Ranges, Shard
from ...engine.shard import ShardEpochs
from ...engine.stats import Stats
from ...errors import ConfigError
from ...image.decode import decode_stage
from ...runtime.loop import ExitOrder, on_exit
from ...runtime.mainmod import unreachable_from_main
from ...runtime.procs import kill_processes, reap_process, start_child
from ...sources.base import Source
from .shares import _per_worker, sub_shard
from .wire import _CREDITS, _STOP, Beat, Cancel, End, StartEpoch, Terminal, _add_figures, _Channel
from .worker import _worker_main, _WorkerSpec

log = logging.getLogger("asyncload")

_CONTEXTS = ("spawn", "forkserver")


@dataclass
class _Proc:
    """One live worker process and the parent's end of its pipe."""

    index: int
    process: BaseProcess
    channel: _Channel

    @property
    def conn(self) -> Connection:
        return self.channel.conn


#: Seconds the workers asked to exit may take before they are killed: an idle worker exits in a few
#: milliseconds; one busy in an epoch would first wait for its reads in flight (a stalled store: forever),
#: and it holds nothing of the user's (a batch's shared memory it left is unlinked when it is joined).
_STOP_GRACE = 0.5


def _stop_workers(procs: dict[int, _Proc], grace: list[float], owner_pid: int) -> None:
    """The pool's finaliser (it must not hold the pool): ask every worker to exit, kill the ones that have
    not within ``grace[0]`` seconds, and join them all."""
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
    kill_processes([w.process for w in live], grace[0])


class WorkerPool:
    """``processes`` persistent worker processes, each reading its sub-shard (``sub_shard``) with a
    ``ShardEpochs`` built once; the parent's side of them: it starts them at the first epoch, asks each for
    its share of an epoch, settles an epoch left open, and stops them. Epochs are read from it with
    ``FanoutIterator(pool, epoch)``, one at a time.

    ``context``: "spawn" or "forkserver" (never "fork": forking where Deep Lake or an event loop is live
    hangs or segfaults). ``timeout``: how long an abandoned epoch may take to settle. ``sampler``: the
    parent's sampler for this shard when the caller has one already (``AsyncLoader``). ``options``: a
    ``LoaderOptions``, or the keyword arguments of one. ``transform`` and ``collate_fn`` must be picklable
    (module level).
    """

    def __init__(
        self,
        source: Source[Any],
        options: LoaderOptions | Mapping[str, Any],
        shard: Shard,
        processes: int,
        *,
        context: str = "forkserver",
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
        # Workers read in order so that every message names its batch (see ``processes.fanout.iterator``), and never
        # fan out again.
        options = _per_worker(options, processes)
        if sampler is None:  # the plan of this shard, as each worker computes its share of it
            sampler = ShardEpochs(source.open(), options, shard).sampler
        self.sampler = sampler
        stage = decode_stage(source.open(), options)
        #: ``decode="cuda"``: the stage the training process runs on each batch (workers ship bytes)
        self.gpu_stage = stage if stage is not None and stage.device is not None else None
        self.with_index = options.with_index
        self.processes = processes
        self.source = source
        self.options = options  # one worker's (its share of the samples in flight)
        self.url = source.url
        self._context = context
        self._timeout = float(timeout)
        # A worker with no batch in any epoch (fewer batches than processes) is not worth a process.
        self._specs = [
            _WorkerSpec(k, source, options, sub_shard(shard, k, processes), _CREDITS)
            for k in range(min(processes, len(sampler)))
        ]  # fmt: skip
        try:
            pickled = ForkingPickler.dumps(self._specs[0] if self._specs else None)
        except Exception as exc:
            raise ConfigError(
                f"processes={processes} needs loader options that can be pickled into a new process "
                f"({type(exc).__name__}: {exc}); define transform and collate_fn at module level"
            ) from exc
        if (unreachable := unreachable_from_main(bytes(pickled))) is not None:
            names, why, fix = unreachable
            raise ConfigError(
                f"processes={processes} cannot send {', '.join(names)} to its worker processes: {why}; {fix}, or "
                "pass processes=0"
            )
        # Whether a worker must import the user's ``__main__`` to unpickle its spec (a transform defined in
        # the script). Otherwise it does not: a script without the ``if __name__ == "__main__"`` guard would
        # run again, whole, in every worker (``isolated`` applies the same rule to its reader).
        self._needs_main = b"__main__" in bytes(pickled)
        self.procs: dict[int, _Proc] = {}
        self._pids: dict[int, int] = {}
        self.gen = 0  # the latest epoch started on the pool
        self.busy: set[int] = set()  # workers that owe epoch ``gen`` its terminal message
        self._grace = [_STOP_GRACE]  # (a list: the finaliser must not hold the pool)
        self._finalizer = on_exit(self, ExitOrder.WORKERS, _stop_workers, self.procs, self._grace, os.getpid())

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def pids(self) -> dict[int, int]:
        """Worker index → pid of the workers started (empty before the first epoch's ``next()``; kept after
        ``close()``), for the logs and errors that name a worker."""
        return dict(self._pids)

    def close(self, *, at_once: bool = False) -> None:
        """Stop and join every worker (asked, killed after ``_STOP_GRACE``, or at once: Ctrl-C, a stall);
        idempotent."""
        if at_once:
            self._grace[0] = 0.0
        self.busy.clear()
        self._finalizer()

    def begin(self, epoch: int, skips: Mapping[int, frozenset[int]], taken: Ranges = ()) -> int:
        """Start the workers if they are not running, settle an epoch still open, and ask worker ``k`` of
        ``skips`` to serve ``epoch`` leaving out its own batches ``skips[k]``; returns the epoch's gen."""
        if self.closed:
            raise RuntimeError(f"asyncload: the fan-out pool for {self.url} is closed")
        self.settle(self.gen)
        if not self.procs:
            self._start()
        self.gen += 1
        for k, own_skip in skips.items():
            self.send(k, StartEpoch(self.gen, epoch, own_skip, taken))
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
                    if (
                        isinstance(msg, Beat)
                        and msg.silent_since is not None
                        and time.monotonic() - msg.silent_since > 2.0
                    ):
                        # Its reads have no answer: it would see the cancel only once they end (a silent
                        # store: never). It holds nothing of the user's: stop the pool now.
                        log.warning(
                            "asyncload: fan-out worker %d for %s is waiting for its store while settling an "
                            "abandoned epoch; restarting the pool at the next epoch", conns[r], self.url,
                        )  # fmt: skip
                        self.close()
                        return
                    if isinstance(msg, Terminal) and msg.gen == gen:
                        self.busy.discard(conns[r])
                        if isinstance(msg, End) and stats is not None:
                            _add_figures(stats, msg.figures)
        except BaseException:
            self.close()  # a broken pipe, or Ctrl-C while settling: stop rather than guess
            raise

    def _start(self) -> None:
        for spec in self._specs:
            self._start_one(spec)

    def _start_one(self, spec: _WorkerSpec) -> None:
        # The source as this process checked it (``Source.reader_copy``: a Deep Lake bucket probed here,
        # credentials resolved now): a worker started while the store is silent (a replacement in a
        # stall) then opens it as Deep Lake does, waiting, instead of failing its own 5 s probe.
        spec = dataclasses.replace(spec, source=self.source.reader_copy())
        proc, parent_end = start_child(
            self._context, _worker_main, (spec,), name=f"asyncload-fanout-{spec.index}", needs_main=self._needs_main
        )
        self.procs[spec.index] = _Proc(spec.index, proc, _Channel(parent_end))
        self._pids[spec.index] = proc.pid  # type: ignore[assignment]

    def replace(self, k: int) -> tuple[int | None, int | None]:
        """Reap worker ``k`` and start a new one in its place, idle; the old worker's ``(pid, exitcode)``."""
        ended = self.reap(k)
        self.restart(k)
        return ended

    def restart(self, k: int) -> None:
        """Start worker ``k`` again (after ``reap``), idle."""
        self._start_one(self._specs[k])

    def reap(self, k: int) -> tuple[int | None, int | None]:
        """Join worker ``k``, dead or alive with a broken pipe (then killed), and release it and whatever
        shared memory it left; its ``(pid, exitcode)``."""
        old = self.procs.pop(k)
        old.channel.close()
        self.busy.discard(k)
        return reap_process(old.process, self._timeout)
