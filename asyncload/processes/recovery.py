"""One recovery policy for the processes that read for a loader: the Deep Lake reader process
(``isolated``) and the fan-out workers (``fanout``).

A reading process ends in one of two ways, and each costs against its own budget:

- **It died** (a signal, an exit): a *crash*. Deep Lake 4.7.4 kills the process that delivers a failed
  read now and then, and a corrupt chunk kills it every time. The process is replaced and what it held is
  read again; a death with other reads in flight says nothing about which read killed it, so the held
  reads are read again *alone*, one at a time. A read that kills its reader while alone is narrowed down
  by halves (``narrow``) until single rows are left: a row that kills two fresh readers alone is named
  (``ReaderCrashError``, every such row of the read in one message) and never read again. Deaths with
  other reads in flight, and reads alone that died although no part of them kills a reader, count
  against ``max_restarts`` per epoch (``Recovery.charge``); deaths while narrowing do not (each halves
  what is left, so they are bounded). Past the budget: ``WorkerError``.
- **It stopped answering**: a *stall*. Deep Lake sets no deadline on a read of a store that accepts
  connections and goes silent, and a read's future cannot be cancelled: the only way out of a stuck read
  is to end the process that runs it. A reader whose oldest read has had no answer for ``limit()``
  seconds is killed (SIGKILL), replaced, and its reads are sent again as they were (a stall is the
  store's, not a row's: nothing is read alone). A stall never spends ``max_restarts``: one outage of the
  store would otherwise end the epoch long before ``stall_timeout``. It is bounded by time instead: the
  whole outage, from the moment the store stopped answering, may last ``stall_timeout`` seconds; past
  it, ``StallError`` names the store, the wait and the rows in flight.

Why these numbers (``read_limit``): a read is declared stuck after a quarter of ``stall_timeout``, at
most 30 s (what the AWS CRT client allows a connection that moves under 1 B/s before it calls it dead;
healthy reads, even cold ones at 50 ms RTT with hundreds in flight, answer within a few seconds). Each
further replacement within one outage waits twice as long as the one before (backoff: a store that stays
silent is not hammered with new processes and new connections, and a replacement's own start and open,
which may stall as well, get more time), and never past the deadline: with the default 120 s, readers
are replaced at 30 s and 90 s and the epoch ends at 120 s. One outage has one clock, whichever reader
saw it and however many were replaced in it: from the store's last answer to any reader (or the oldest
unanswered read, if later) to its next answer. As the pipeline's watchdog does in one process, it is
warned about once past ``STALL_WARN_S`` ("no answer from <url> for 30 s; waiting up to 120 s"), with an
info line when the store answers again, and ``Stats.stalls`` / ``Stats.stall_wait_s`` count the outages
past ``STALL_NOTICE_S`` that were ridden out. When the store answers, every reader's silence counts from
that answer (``Recovery.stuck``): a reader that was silent in the outage is not taken for stuck in a new
one by what it said before its reads answered.

The module holds the decisions and the words; the two callers hold the processes: ``isolated`` awaits
reads on an event loop, ``processes.fanout.iterator`` blocks in ``multiprocessing.connection.wait``. So
the reads alone after a death (the read again, the search by halves, the charge, the rows named or left
out) are one generator, ``Recovery.read_alone``, that yields each read it needs (``Alone``) and is sent
how it went; ``drive`` and ``drive_async`` run it, each caller with its own way to read rows alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

from ..engine.stats import Stats
from ..errors import ReaderCrashError, StallError, WorkerError, _short
from ..runtime.procs import cause_of_death, how_it_ended

log = logging.getLogger("asyncload")
T = TypeVar("T")

#: The longest a read may go unanswered before its reader is declared stuck (see the module doc).
MAX_READ_LIMIT = 30.0


def read_limit(stall_timeout: float) -> float:
    """Seconds without an answer after which a reader is stuck: a quarter of ``stall_timeout``, at most
    ``MAX_READ_LIMIT`` (so that a deadline leaves room for a replacement and its backoff)."""
    return min(MAX_READ_LIMIT, stall_timeout / 4)


def beat_interval(stall_timeout: float) -> float:
    """How often a stuck reader is looked for (and a fan-out worker says how its reads go): a tenth of the
    read limit, between 50 ms and 1 s."""
    return max(0.05, min(1.0, read_limit(stall_timeout) / 10))


@dataclass(frozen=True)
class Ended:
    """How a reading process ended: ``exitcode`` as ``multiprocessing`` gives it; ``stalled``: it was
    killed here because it stopped answering (``silent_s`` seconds without an answer)."""

    pid: int | None
    exitcode: int | None
    stalled: bool = False
    silent_s: float = 0.0
    #: what is known of its end where the exit code is not (the node's shared reader, another loader's child)
    note: str | None = None

    @property
    def how(self) -> str:
        if self.note is not None and not self.stalled:
            return self.note
        if self.stalled:
            return f"stopped answering (no answer for {self.silent_s:.1f} s: killed)"
        return how_it_ended(self.exitcode)

    @property
    def signal(self) -> str:
        return cause_of_death(self.exitcode)


@dataclass(frozen=True)
class Alone:
    """A read that ``Recovery.read_alone`` asks its caller for: ``rows`` read with nothing else in flight,
    by a reader that may die of it; ``probe``: only to learn whether it does (its answer is dropped)."""

    rows: list[int]
    probe: bool = False


#: What a caller sends back for an ``Alone``: the reader's ``Ended`` when the read killed it (a new reader
#: is in its place), or else the read's answer (for a probe: anything; the reader lived).
Outcome = Any
#: ``Recovery.read_alone`` as its callers drive it.
Steps = Generator[Alone, Outcome, T]


def narrow(rows: list[int], ended: Ended) -> Steps[list[tuple[int, Ended]]]:
    """The search for the rows whose read kills a reader. ``rows`` were read alone and that killed a
    reader (``ended``). Yields a part of ``rows`` to read alone, as a probe, and is sent how that went: how
    the reader ended, or anything else when it answered (data or an error: either way the reader lived). A
    stall is no answer: the caller reads the same part again. Returns every row that killed two readers
    alone, with how the last one ended (none when the death came and went)."""
    if len(rows) == 1:
        again = yield Alone(rows, probe=True)
        return [(rows[0], again)] if isinstance(again, Ended) else []
    found: list[tuple[int, Ended]] = []
    half = len(rows) // 2
    for part in (rows[:half], rows[half:]):
        died = yield Alone(part, probe=True)
        if isinstance(died, Ended):
            found += yield from narrow(part, died)
    return found


def drive(steps: Steps[T], read: Callable[[Alone], Outcome]) -> T:
    """Run ``steps`` (``Recovery.read_alone``) to its end, each read done by ``read``, which blocks."""
    got: Outcome = None
    while True:
        try:
            ask = steps.send(got)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        got = read(ask)


async def drive_async(steps: Steps[T], read: Callable[[Alone], Awaitable[Outcome]]) -> T:
    """``drive``, each read awaited."""
    got: Outcome = None
    while True:
        try:
            ask = steps.send(got)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        got = await read(ask)


class Recovery:
    """One epoch's decisions for the processes that read ``url``: what a death or a stall costs, when the
    epoch ends, and what is said. Not thread-safe: each caller holds it under its own lock (``isolated``)
    or uses it from the consumer's thread only (``fanout``)."""

    def __init__(
        self, url: str, *, max_restarts: int, stall_timeout: float, stats: Stats | None = None, report: bool = True
    ) -> None:
        self.url = url
        #: say and count the outages (the warning, the line when the store answers, ``stats.stalls``); off
        #: where the epoch's own pipeline watches the same reads and says so itself
        self.report = report
        self.max_restarts = max_restarts
        self.stall_timeout = stall_timeout
        self.base_limit = read_limit(stall_timeout)
        self.stats = stats
        self.crashes = 0  # charged deaths this epoch
        self.outage_since: float | None = None  # monotonic time the store stopped answering, during an outage
        self.replaced = 0  # stuck readers replaced in this outage
        # The pipeline's thresholds, so that an outage is counted and warned about alike whichever path read
        # it: counted from ``notice`` seconds of silence, warned at ``warn``. (Imported here, not at the top:
        # this module is imported by the reader process, which must not import the pipeline's torch.)
        from ..engine.pipeline import STALL_NOTICE_S, STALL_WARN_S

        self.notice = min(STALL_NOTICE_S, stall_timeout / 4)
        self.warn = min(STALL_WARN_S, stall_timeout / 4)
        self.warned = False  # this outage was warned about (once)
        self.last_answer = 0.0  # monotonic time of the last answer from any reading process
        self.recovered_at = 0.0  # monotonic time the last outage ended (the store answered again)

    # -- crashes ---------------------------------------------------------------------------------
    def charge(self, name: str, ended: Ended, rows: Sequence[int], held: str) -> WorkerError | None:
        """Count one death against ``max_restarts``. Past it, the ``WorkerError`` that ends the epoch,
        naming the process (``name``), how it ended, and what it held (``held``, e.g. "reads of indices")."""
        self.crashes += 1
        if self.crashes <= self.max_restarts:
            return None
        budget = self.max_restarts
        more = f", after {budget} restarts this epoch (max_restarts={budget})" if budget else ""
        return self.fatal(name, ended, rows, held, more)

    def fatal(self, name: str, ended: Ended, rows: Sequence[int], held: str, why: str) -> WorkerError:
        """The ``WorkerError`` that ends the epoch after ``name`` ended (``why``: what follows, e.g. why no
        process could replace it); carries ``pid``, ``exitcode`` and ``indices``."""
        err = WorkerError(f"asyncload {name} {ended.how} holding {held} {_short(list(rows))}{why}")
        err.pid, err.exitcode, err.indices = ended.pid, ended.exitcode, list(rows)  # type: ignore[attr-defined]
        return err

    def log_restart(self, name: str, ended: Ended, rows: Sequence[int], held: str, new_pid: int | None,
                    *, charged: bool) -> None:  # fmt: skip
        """One warning per replaced process: who ended, how, what it held, who reads it now."""
        if ended.stalled:
            note = " (a stall: not counted in max_restarts)"
        elif charged:
            note = f" (restart {self.crashes} of {self.max_restarts} this epoch)"
        else:
            note = " (read alone, to find the row that kills it)"
        who = f"a new reader (pid {new_pid})" if new_pid is not None else "this process"  # (a DataLoader worker)
        log.warning(
            "asyncload: %s %s holding %s %s; %s reads them again%s",
            name, ended.how, held, _short(list(rows), limit=1024), who, note,
        )  # fmt: skip

    def crash_error(self, rows: Sequence[int], ended: Sequence[Ended]) -> ReaderCrashError:
        """The error for dataset rows ``rows`` (row ids, not positions) whose reads killed their reader
        each time, alone: every one of them is named, with how the readers ended."""
        sigs = ", ".join(sorted({e.signal for e in ended}))
        which = f"row {rows[0]}" if len(rows) == 1 else f"rows {_short(list(rows))}"
        return ReaderCrashError(
            f"reading {which} of {self.url} killed its reader process ({sigs}) each time it was read, alone, "
            f"in a new reader", source=self.url, indices=list(rows), signal=sigs,
        )  # fmt: skip

    @staticmethod
    def skip_reason(ended: Ended) -> str:
        """What ``on_error="skip"`` records for a row that kills its reader."""
        return f"ReaderCrashError: reading it killed its reader process ({ended.signal})"

    def read_alone(
        self, rows: list[int], *, name: Callable[[int | None], str], held: str,
        row_ids: Callable[[list[int]], list[int]], skip: bool = False,
        found: Callable[[list[tuple[int, Ended]]], None] = lambda bad: None,
        lock: AbstractContextManager[Any] | None = None,
    ) -> Steps[Outcome]:  # fmt: skip
        """Positions ``rows``, held by a reader that died with other reads in flight, read again alone
        (``Alone``; the caller reads and sends back how it went). Returns the answer, or None when ``skip``
        left every row out. A read that kills the reader again is narrowed down (``narrow``): the rows that
        kill two fresh readers alone are given to ``found`` and named in a ``ReaderCrashError``, raised
        (rows in order of position, ``row_ids`` their ids), or with ``skip`` counted in ``stats`` as left
        out, and the rest is read again. A death whose rows kill no reader alone (it came and went) costs
        one restart (``charge``, under ``lock``: ``name(pid)`` names the reader, ``held`` what it held),
        and the read is tried again; past ``max_restarts``, its ``WorkerError`` is raised."""
        while True:
            outcome = yield Alone(rows)
            if not isinstance(outcome, Ended):
                return outcome
            bad = sorted((yield from narrow(rows, outcome)), key=lambda hit: hit[0])
            if not bad:  # a crash that comes and goes: charged, then read again
                with lock or nullcontext():
                    err = self.charge(name(outcome.pid), outcome, rows, held)
                if err is not None:
                    raise err
                continue
            found(bad)
            ids = row_ids([r for r, _ in bad])
            if not skip:
                raise self.crash_error(ids, [e for _, e in bad])
            assert self.stats is not None
            self.stats.record_skipped([(i, self.skip_reason(e)) for i, (_, e) in zip(ids, bad, strict=True)])
            gone = {r for r, _ in bad}
            rows = [r for r in rows if r not in gone]
            if not rows:
                return None

    # -- stalls ----------------------------------------------------------------------------------
    def limit(self, since: float) -> float:
        """Seconds a reader may leave its oldest read (sent, or the reader ready, at ``since``) without an
        answer before it is stuck: ``base_limit``, doubled for each reader already replaced in this outage,
        and never past the outage's deadline."""
        limit = self.base_limit * 2**self.replaced
        if self.outage_since is not None:
            limit = min(limit, max(0.0, self.outage_since + self.stall_timeout - since))
        return limit

    def stuck(self, since: float, now: float) -> bool:
        """Whether a reader whose oldest unanswered read dates from ``since`` is stuck at ``now``. A silence
        that began before the store came back from an outage counts from its return (``recovered_at``): that
        outage was the store's, and has been charged to it; what a reader says of it may be a beat late (a
        fan-out worker's ``Beat`` from before its reads answered), and the backoff that had spared it is
        reset, so judged from its own ``since`` it would be killed as the store answers and counted as a
        second outage."""
        since = max(since, self.recovered_at)
        return now - since >= self.limit(since)

    def stalled(self, silent_since: float, rows: Sequence[int], now: float | None = None) -> StallError | None:
        """A stuck reader was killed; its reads have had no answer since ``silent_since``. The store has
        been silent since then, or since it last answered any reader if that is later: an outage begins
        there if none is in progress (its deadline runs from it; it is warned about and counted as any
        other, past ``warn`` and ``notice``). Counts a replacement, and returns the ``StallError`` that ends
        the epoch once the outage has lasted ``stall_timeout`` (None: replace it and read again)."""
        now = time.monotonic() if now is None else now
        if self.outage_since is None:
            self.outage_since = max(silent_since, self.last_answer)
        self._warn(now, ", replacing readers stuck in their reads")
        self.replaced += 1
        waited = now - self.outage_since
        if waited >= self.stall_timeout - 0.05:  # the limits are cut at the deadline: this is it
            return self.stall_error(waited, rows)
        return None

    def silence(self, since: float, now: float | None = None) -> None:
        """A reading process says its reads have had no answer since ``since`` (a fan-out worker's beat):
        with no answer from any other since then either, that is the store's silence. Past ``notice`` it is
        an outage (counted once the store answers, as the pipeline counts one); past ``warn``, warned about,
        once (the workers' own pipelines do not say it: ``fanout.worker``). One clock for the whole outage,
        whichever process saw it first, and the stuck-process deadline (``limit``) runs from its start."""
        now = time.monotonic() if now is None else now
        began = max(since, self.last_answer)
        if self.outage_since is None and now - began >= self.notice:
            self.outage_since = began
        self._warn(now)

    def _warn(self, now: float, doing: str = "") -> None:
        """The warning, once per outage, once it has lasted ``warn`` (as the pipeline's watchdog warns)."""
        if self.outage_since is None or self.warned or not self.report or now - self.outage_since < self.warn:
            return
        self.warned = True
        log.warning(
            "asyncload: no answer from %s for %.0f s; waiting up to %.0f s (stall_timeout) for it%s",
            self.url, now - self.outage_since, self.stall_timeout, doing,
        )  # fmt: skip

    def stall_error(self, waited: float, rows: Sequence[int]) -> StallError:
        return StallError(
            f"no answer from {self.url} for {waited:.1f} s (stall_timeout={self.stall_timeout:g} s): gave up "
            f"with {len(rows)} rows in flight {_short(sorted(rows))}",
            source=self.url, indices=sorted(rows), waited_s=waited,
        )  # fmt: skip

    def answered(self, now: float | None = None) -> None:
        """The store answered: an outage in progress is over (counted in ``stats`` if it lasted ``notice``,
        as the pipeline counts one; said in the log if it was warned about), and every reader's silence
        counts from now (``stuck``)."""
        now = time.monotonic() if now is None else now
        self.last_answer = max(self.last_answer, now)
        if self.outage_since is None:
            return
        waited = now - self.outage_since
        warned, self.warned = self.warned, False
        self.outage_since, self.replaced = None, 0
        self.recovered_at = now
        if not self.report or waited < self.notice:  # (a reader replaced as the store answered the others)
            return
        if self.stats is not None:
            self.stats.stalls += 1
            self.stats.stall_wait_s += waited
        if warned:
            log.info("asyncload: %s answered again after %.1f s without an answer", self.url, waited)
