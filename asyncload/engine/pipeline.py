"""The coroutines of one epoch: producer, fetchers, flow control, ordered delivery. On the loop thread.

What a fetcher calls to read is in ``hedging`` (a straggler gets a second request); what turns a batch's
parts into the batch, on the CPU pool, is in ``assembly``; what the epoch is to read is the ``plan``.

::

    plan ─▶ producer ──(batch slot)──▶ work queue ─▶ N fetchers ─await source.read─▶ parts
               ▲                                                                       │
               └──── slot released when the consumer takes a batch ◀── ready queue ◀── assemble (CPU pool)

- A batch takes a *slot* before its reads are issued and gives it back only when the consumer takes it,
  so everything held (in flight, assembling, waiting for its turn, ready) is bounded by the slot count.
  The producer waits for a slot by awaiting; nothing on the loop thread blocks.
- ``N`` fetchers each keep one request of ``request_size`` indices in flight, so at most ``N * request_size`` samples
  (the loader's ``concurrency``) are being read.
- The first batch's requests go out alone, its first sample in a request of its own; the rest follow once
  a read has answered. Issued all at once, the first batch queued behind everyone else's transfers and
  decoding on a busy client. The lone sample is what the byte budget waits for (its first measure of bytes
  per sample admits the other batches): one row of a cold dataset answers sooner than a batch's rows
  spread over every chunk (at 50 ms, packet-level: ~0.2 s sooner; the 640th sample of a 4,000-row JPEG
  epoch came 0.2-0.3 s earlier, benchmarks/results/first_epoch/).
- Stopping: ``stop()`` drains the work queue; reads in flight are cancelled where the source says that is
  safe (``Source.cancel_safe``: HTTP requests, a reader process's answers) and awaited otherwise (a
  cancelled Deep Lake future hangs for ever). ``abandon()`` gives up on those too: the fetchers stop
  waiting and the reads are left to end on a loop kept running for them (``LoopThread.linger``).
- A deadline for a silent store (``plan.stall_timeout``): a watchdog notes the last time any read
  answered. Reads in flight with none answering for a while is a stall: warned once past
  ``min(30 s, stall_timeout / 4)``, counted in ``stats.stalls`` when the store answers again, and past
  ``stall_timeout`` the consumer gets ``StallError`` (naming the store, the wait, the rows in flight)
  and the reads are abandoned. The watchdog costs the read path one clock read per request.
- With ``on_error="skip"``, a failed request is re-read sample by sample so that only the bad samples are
  left out; each is recorded (index and cause) in the stats.
- Memory is bounded in bytes too (``plan.budget``): a new batch takes a slot only while the batches alive
  (being read, decoded or ready) are estimated to fit (``budget.ByteBudget``).
- A decode stage (``plan.stage``, seen here only as ``plan.ReadStage``) sees each read before it is
  counted: it may have samples read again (an lz4 mask whose size is not its image's, decoded by the store),
  and those reads go through the same gate, hedger and in-flight count as every other (``_request``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import queue
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, ReadError, StallError, WorkerError, read_error
from ..runtime.loop import LoopThread, cores_available
from .assembly import assemble
from .budget import ByteBudget, part_bytes
from .hedging import Hedger
from .plan import Plan, ReadStage
from .protocol import END, Failure, Ready
from .stats import Stats, Timeline, wire_counter
from .tuning import Observation

log = logging.getLogger("asyncload")
#: A line every ``STALL_SHOW_S`` while a stall lasts, at INFO: silent unless asked for (``asyncload load``
#: shows them); the warning once and the line when the store answers again go to ``log``.
stall_log = logging.getLogger("asyncload.stall")
STALL_SHOW_S = 5.0

#: A silence shorter than this (or than a quarter of ``stall_timeout``) is not counted as a stall.
STALL_NOTICE_S = 5.0
#: A silence longer than this (or than a quarter of ``stall_timeout``) is logged as a warning, once.
STALL_WARN_S = 30.0


def _requests(n: int, size: int, probe: bool) -> list[tuple[int, int]]:
    """The requests of a batch of ``n`` indices, ``size`` at a time; with ``probe``, its first sample alone
    first."""
    if probe and n > 1:
        return [(0, 1), *((s, min(s + size, n)) for s in range(1, n, size))]
    return [(s, min(s + size, n)) for s in range(0, n, size)]


class _RequestGate:
    """Requests in flight, at most ``allowed`` (the tuner moves it while fetchers wait on the gate)."""

    def __init__(self, allowed: int) -> None:
        self.allowed = allowed
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def acquire(self) -> None:
        while self.active >= self.allowed:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        self._wake()

    def allow(self, requests: int) -> None:
        self.allowed = requests
        self._wake()

    def _wake(self) -> None:
        free = self.allowed - self.active
        while free > 0 and self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                free -= 1


@dataclass
class _Batch:
    pos: int  # position in this run's plan (drives the reorder buffer)
    seq: int  # sequence number in the shard's epoch plan (what resume state names)
    indices: list[int]
    pending: int
    parts: dict[int, tuple[list[int], Any]] = field(default_factory=dict)
    held: int = 0  # bytes of ``parts``, counted in ``Stats.bytes_held`` until the batch is assembled
    skipped: list[tuple[int, str]] = field(default_factory=list)
    failed: bool = False
    read_done: float = 0.0  # when its last read answered (``perf_counter``; ``stats.Timeline``)


class Pipeline:
    """One epoch's coroutines. ``run()`` is submitted to the loop; ``stop``/``release_slot`` are
    scheduled onto the loop by the consumer."""

    def __init__(self, plan: Plan, out: queue.SimpleQueue[Any], lt: LoopThread, stats: Stats) -> None:
        self.plan = plan
        self.out = out
        self.lt = lt
        self.stats = stats
        self.stopping = False
        self._next_pos = 0
        self._reorder: dict[int, Any] = {}
        self._assembling: set[asyncio.Task[None]] = set()
        self._issued_all = False  # the producer has issued every batch of the epoch
        self._cancel_safe = plan.source.cancel_safe
        # Reads that cannot be cancelled run as tasks of their own, shielded, so that giving up on them
        # (``abandon``) stops the waiting without touching the read.
        self._uncancellable: set[asyncio.Future[Any]] = set()
        reads = plan.reads
        if reads is not None:
            reads.attach(stats)
        read, again = (reads.read, reads.read_alone) if reads is not None else (plan.source.read, plan.source.read)
        if not self._cancel_safe:
            read, again = functools.partial(self._shielded, read), functools.partial(self._shielded, again)
        self._hedger = Hedger(read, stats, plan.hedge, plan.hedge_min_s, again=again)
        # ``remote_bytes``: the source's own count of bytes received where it keeps one (the wire), else the
        # read stage's count of rows fetched (``BlockReads``), else the answers' bytes (``_count_remote``)
        self._wire = wire_counter(plan.source)
        self._wire_at_start = self._wire() if self._wire is not None else 0
        self._fetchers: list[asyncio.Task[None]] = []
        self._reading: dict[int, list[int]] = {}  # the rows of each request in flight (for a stall's message)
        self._last_answer = time.perf_counter()  # when a read last answered (success or failure)
        self._stall_warned = False  # the silence in progress was warned about (the watchdog's)
        self._abandoned = False
        self._assembled = 0  # samples assembled (what ``cpu_decode_s`` and ``cpu_collate_s`` were spent on)
        # Created here, not in run(): stop() may be scheduled before run()'s first step. (Since Python
        # 3.10 asyncio primitives bind to the running loop on first use, not at construction.)
        self._slots = asyncio.Semaphore(plan.slots(plan.requests))
        self._slot_count = plan.slots(plan.requests)
        self._slot_debt = 0  # slots to swallow on release after the requests allowed went down
        first = len(_requests(plan.batch_size, plan.request_size, probe=True))  # the first batch's requests
        self._held: int | None = plan.requests if plan.requests > first else None  # the rest, until a read answers
        self._gate = _RequestGate(first if self._held else plan.requests)
        self._work: asyncio.Queue[tuple[_Batch, int, int] | None] = asyncio.Queue()
        self.stats.concurrency = plan.requests * plan.request_size
        self.stats.cpu_workers = lt.cpu_workers
        self._stage: ReadStage | None = plan.stage
        # the decode stage's columns: the epoch's reads return them as stored bytes (``Source.read``'s ``raw``)
        self._raw: frozenset[str] = self._stage.encoded if self._stage is not None else frozenset()
        ratio = self._stage.decoded_ratio if self._stage is not None else None
        held = (lambda: reads.held_bytes) if reads is not None else None  # rows read ahead, in the heap
        self._budget = ByteBudget(plan.budget, plan.batch_size, stats, ratio, held)

    async def run(self) -> None:
        plan = self.plan
        cpu0 = time.thread_time()  # this is the loop thread: its CPU is the fetch side's share
        self._fetchers = fetchers = [asyncio.create_task(self._fetch()) for _ in range(plan.fetchers)]
        watcher = asyncio.create_task(self._watch()) if plan.tuner or plan.log_every else None
        watchdog = asyncio.create_task(self._watchdog())
        for pos, (seq, indices) in enumerate(plan.batches):
            await self._budget.room()
            await self._slots.acquire()
            if self.stopping:
                break
            self._budget.admit()
            bounds = _requests(len(indices), plan.request_size, probe=pos == 0)
            batch = _Batch(pos, seq, indices, pending=len(bounds))
            for s, e in bounds:
                self._work.put_nowait((batch, s, e))
        self._issued_all = True
        for _ in fetchers:
            self._work.put_nowait(None)
        for done in await asyncio.gather(*fetchers, return_exceptions=True):  # cancelled by stop/abandon
            if isinstance(done, BaseException) and not isinstance(done, asyncio.CancelledError):
                raise done
        # Wait on tasks not yet done: from Python 3.12 ``gather`` of finished futures returns without
        # letting the loop run, so a finished task whose discard callback is still queued would keep
        # ``while self._assembling`` spinning forever (seen under Ctrl-C on a 16-core machine).
        while busy := [t for t in self._assembling if not t.done()]:
            await asyncio.gather(*busy, return_exceptions=self.stopping)
        if not self._abandoned:
            await self._hedger.drain()  # reads lost to a hedge must end before the loop may close
        watchdog.cancel()
        self._stall_ended()
        if watcher is not None:
            watcher.cancel()  # it only sleeps and reads counters: safe to cancel
        if self._abandoned:
            self.lt.linger(self._uncancellable)  # reads that could not be cancelled end on this loop
        self.stats.cpu_loop_s = time.thread_time() - cpu0
        if not self.stopping:
            self.out.put(END)

    # -- concurrency tuning and the periodic stats line -----------------------------------------
    def allow(self, requests: int) -> None:
        """Move the requests allowed in flight, and the batch slots with them (memory follows)."""
        self._held = None
        self._gate.allow(requests)
        self.stats.concurrency = requests * self.plan.request_size
        want = self.plan.slots(requests)
        delta, self._slot_count = want - self._slot_count, want
        if delta < 0:
            self._slot_debt -= delta
            return
        paid = min(delta, self._slot_debt)
        self._slot_debt -= paid
        for _ in range(delta - paid):
            self._slots.release()

    async def _watch(self) -> None:
        plan, st, tuner = self.plan, self.stats, self.plan.tuner
        last_log = t0 = time.perf_counter()
        n0, w0, thr0 = st.samples_read, st.consumer_wait(t0), plan.source.throttle_count()
        while True:
            await asyncio.sleep(0.1)
            now = time.perf_counter()
            if plan.log_every and now - last_log >= plan.log_every:
                last_log = now
                log.info("asyncload %s: %s", plan.source.url, st.line())
            if tuner is None:
                continue
            done = st.samples_read - n0
            # An interval is a few read round trips (so the change of the last step has shown), and
            # enough completed reads to measure, or at most 2 s.
            recent = sorted(list(st.latencies)[-64:])
            p50 = recent[len(recent) // 2] if recent else 0.05
            throttled = plan.source.throttle_count() - thr0
            enough = done >= max(4, min(2 * st.concurrency, 64)) or now - t0 >= 2.0
            if not throttled and (now - t0 < max(0.1, 4 * p50) or not enough):
                continue  # (a throttling answer is acted on at once)
            waited = st.consumer_wait(now) - w0
            # Judge only the middle of an epoch: its first interval pays the start-up, and once every
            # batch has been issued the tail drains, so throughput falls whatever is in flight.
            if throttled or (st.batches_yielded > 0 and not self._issued_all):  # throttling: back off always
                obs = Observation(
                    done / (now - t0), consumer_bound=waited < 0.02 * (now - t0), throttled=throttled, latency_s=p50,
                    assemble_rate=self._assemble_rate(),
                )  # fmt: skip
                samples = tuner.observe(obs)
                self.allow(max(1, samples // plan.request_size))
            t0, n0, w0, thr0 = now, st.samples_read, st.consumer_wait(now), thr0 + throttled

    def _assemble_rate(self) -> float | None:
        """Samples/s the CPU pool could assemble at: its threads (at most the cores this process may use)
        over the thread CPU seconds a sample's assembly took so far. None until a batch was assembled."""
        st = self.stats
        cpu = st.cpu_decode_s + st.cpu_collate_s
        if cpu <= 0.0 or self._assembled <= 0:
            return None
        return min(self.lt.cpu_workers, cores_available()) * self._assembled / cpu

    # -- scheduled by the consumer ---------------------------------------------------------------
    def release_slot(self) -> None:
        self._budget.taken()
        if self._slot_debt:
            self._slot_debt -= 1
            return
        self._slots.release()

    def stop(self) -> None:
        """Issue no more reads; cancel those in flight where that is safe, else let them finish; wake the
        producer so it can exit."""
        if self.stopping:
            return
        self.stopping = True
        self._budget.close()
        while not self._work.empty():
            self._work.get_nowait()
        for _ in range(self.plan.fetchers):  # the drain may have taken the producer's end markers
            self._work.put_nowait(None)
        self._slots.release()
        if self._cancel_safe:
            self.abandon()

    def abandon(self) -> None:
        """Stop waiting for the reads in flight: cancel the fetchers (a read that cannot be cancelled runs
        on, shielded, and the loop lingers for it), the batches being assembled and the hedged-away reads
        (where cancelling is safe). For a silent store, Ctrl-C, or a stop past ``shutdown_timeout``."""
        self.stop()
        if self._abandoned:
            return
        self._abandoned = True
        for task in (*self._fetchers, *self._assembling):
            task.cancel()
        if self._cancel_safe:
            self._hedger.cancel()

    async def _shielded(
        self, read: Callable[[list[int], frozenset[str]], Awaitable[Any]], idx: list[int], raw: frozenset[str]
    ) -> Any:
        """``read(idx, raw)`` in a task of its own that a cancelled waiter leaves running (see ``abandon``)."""
        task = asyncio.ensure_future(read(idx, raw))
        self._uncancellable.add(task)
        task.add_done_callback(self._uncancellable.discard)
        return await asyncio.shield(task)

    # -- the deadline for a silent store ---------------------------------------------------------
    async def _watchdog(self) -> None:
        """Give up on a store that has not answered for ``stall_timeout`` while reads were in flight;
        warn once it has been silent a while; count the stalls it came back from (module docstring)."""
        plan, st = self.plan, self.stats
        limit = plan.stall_timeout
        notice, warn = min(STALL_NOTICE_S, limit / 4), min(STALL_WARN_S, limit / 4)
        tick = min(0.25, limit / 20)
        st.stall_timeout = limit
        quiet_from = time.perf_counter()  # reads have been in flight since (or the last answer, if later)
        shown = 0.0  # the silence last shown on ``stall_log``
        while True:
            await asyncio.sleep(tick)
            now = time.perf_counter()
            answered = self._last_answer
            self._stall_ended()
            if not st.in_flight:
                quiet_from = now
                continue
            since = max(answered, quiet_from)
            silent = now - since
            if silent >= notice and st.stall_since is None:
                st.stall_since = since
                shown = -STALL_SHOW_S  # shown at once, then every STALL_SHOW_S
            if st.stall_since is not None and silent - shown >= STALL_SHOW_S:
                shown = silent
                stall_log.info(
                    "waiting for %s: no answer for %.0f s (deadline %.0f s)", plan.source.url, silent, limit
                )  # fmt: skip
            if silent >= warn and not self._stall_warned:
                self._stall_warned = True
                log.warning(
                    "asyncload: no answer from %s for %.0f s (%d rows in flight); waiting up to %.0f s (stall_timeout)",
                    plan.source.url, silent, st.in_flight, limit,
                )  # fmt: skip
            if silent >= limit:
                self._give_up(silent)
                return

    def _stall_ended(self) -> None:
        """The store answered after a stall began: count it, and say so where it was warned about. From the
        watchdog's tick, and once more when the run ends (an answer in the last tick ends the epoch first)."""
        st = self.stats
        if st.stall_since is None or self._last_answer <= st.stall_since:
            return
        waited = self._last_answer - st.stall_since
        st.stalls += 1
        st.stall_wait_s += waited
        st.stall_since = None
        if self._stall_warned:
            log.info("asyncload: %s answered again after %.1f s without an answer", self.plan.source.url, waited)
            self._stall_warned = False

    def _give_up(self, silent: float) -> None:
        """``stall_timeout`` passed without an answer: the consumer gets ``StallError`` now (ahead of any
        batch still waiting for its turn) and the reads in flight are abandoned."""
        url, limit = self.plan.source.url, self.plan.stall_timeout
        rows = sorted(i for idx in self._reading.values() for i in idx)
        shown = ", ".join(map(str, rows[:16])) + (", ..." if len(rows) > 16 else "")
        where = "" if self._cancel_safe else "; those reads cannot be cancelled and are left to end on their own"
        try:
            why = self.plan.source.outage()
        except Exception:  # noqa: BLE001 - only a message
            why = None
        why = f" ({why})" if why else ""
        err = StallError(
            f"no answer from {url} for {silent:.1f} s (stall_timeout={limit:g} s): the store stopped answering{why} "
            f"with {len(rows)} rows in flight [{shown}]{where}. Raise stall_timeout to wait longer for this store",
            source=url, indices=rows, waited_s=silent,
        )  # fmt: skip
        log.error("asyncload: %s", err)
        self.stats.stall_since = None
        self.out.put(Failure(err))
        self.abandon()  # (stops: no batch is delivered after this error)

    # -- fetch -----------------------------------------------------------------------------------
    async def _request(self, idx: list[int], raw: frozenset[str]) -> Any:
        """One request through the gate, the hedger, the in-flight count and the watchdog's clock: every
        read of the epoch goes through here, a decode stage's reads again included. ``raw``: the columns
        this request returns as stored bytes (``Source.read``'s)."""
        stats = self.stats
        await self._gate.acquire()
        stats.requests += 1
        stats.in_flight += len(idx)
        key = id(idx)
        self._reading[key] = idx
        try:
            part, seconds = await self._hedger.read(idx, raw)
        except (ReadError, WorkerError, ConfigError):  # WorkerError: the reader process died past its restart
            raise  # budget; ConfigError: a setting the read stage found wrong (``cache_limit``)
        except Exception as exc:
            raise read_error(self.plan.source.url, None, idx, exc) from None
        finally:
            self._last_answer = time.perf_counter()  # (cancelled: no answer, but nothing waits any more)
            if self._wire is not None:
                stats.remote_bytes = self._wire() - self._wire_at_start
            del self._reading[key]
            stats.in_flight -= len(idx)
            self._gate.release()
            if self._held is not None:  # the first read has answered: the rest may go
                self._gate.allow(self._held)
                self._held = None
        stats.latencies.append(seconds)
        stats.read_s += seconds
        if self._wire is None and self.plan.reads is None:  # no read stage to count the rows fetched
            stats.remote_bytes += part_bytes(part)
        if stats.first_read_s is None:
            stats.first_read_s = time.perf_counter() - stats.started
        return part

    async def _read(self, idx: list[int]) -> tuple[Any, int]:
        """The columns read for ``idx`` (as the decode stage completed them), and their bytes (now held
        against the budget)."""
        part = await self._request(idx, self._raw)
        if self._stage is not None:
            part = await self._stage.complete(part, functools.partial(self._read_again, idx))
        self.stats.samples_read += len(idx)
        nbytes = self._budget.read(part, len(idx))
        self.stats.bytes_read += nbytes
        return part, nbytes

    async def _read_again(self, idx: list[int], positions: list[int], raw: frozenset[str]) -> Any:
        """The decode stage's ``read_again``: the samples at ``positions`` of the read of ``idx``, ``raw``
        as stored bytes."""
        return await self._request([idx[k] for k in positions], raw)

    async def _fetch(self) -> None:
        while (item := await self._work.get()) is not None:
            batch, start, end = item
            if batch.failed or self.stopping:
                continue
            idx = batch.indices[start:end]
            try:
                part, nbytes = await self._read(idx)
                batch.parts[start] = (idx, part)
                batch.held += nbytes
            except Exception as exc:  # noqa: BLE001 - delivered to the consumer, or skipped
                if self.plan.on_error == "raise" or isinstance(
                    exc, (WorkerError, StallError, ConfigError)
                ):  # no sample's
                    self._fail(batch, exc)
                    continue
                await self._salvage(batch, start, idx, exc)
            batch.pending -= 1
            if batch.pending == 0 and not self.stopping:
                batch.read_done = time.perf_counter()
                task = asyncio.create_task(self._finish(batch))
                self._assembling.add(task)
                task.add_done_callback(self._assembling.discard)

    async def _salvage(self, batch: _Batch, start: int, idx: list[int], exc: Exception) -> None:
        """``on_error="skip"``: keep the good samples of a failed group, record the bad ones."""
        if len(idx) == 1:
            batch.skipped.append((idx[0], f"{type(exc).__name__}: {exc}"))
            return
        for k, i in enumerate(idx):
            if self.stopping:
                return
            try:
                part, nbytes = await self._read([i])
                batch.parts[start + k] = ([i], part)
                batch.held += nbytes
            except Exception as one:  # noqa: BLE001 - recorded
                batch.skipped.append((i, f"{type(one).__name__}: {one}"))

    # -- assemble and deliver --------------------------------------------------------------------
    async def _finish(self, batch: _Batch) -> None:
        ordered = [batch.parts[s] for s in sorted(batch.parts)]
        try:
            done = await self.lt.run_cpu(assemble, self.plan, ordered)
        except Exception as exc:  # noqa: BLE001 - delivered to the consumer
            exc.add_note(
                f"asyncload: while assembling the batch of indices {batch.indices[:16]} from {self.plan.source.url}"
            )
            self._fail(batch, exc)
            return
        finally:
            batch.parts.clear()
            self._budget.assembled(batch.held)
        st = self.stats
        st.cpu_decode_s += done.decode_s
        st.cpu_collate_s += done.collate_s
        self._assembled += done.count
        dec, aug, tr, col = done.wall
        st.decode_s += dec
        st.augment_s += aug
        st.transform_s += tr
        st.collate_s += col
        self._budget.ready(done.batch, done.count)
        st.record_skipped(batch.skipped + done.skipped)
        self._deliver(batch.pos, Ready(batch.seq, done.count, done.batch), (batch.read_done, done.started, done.wall))

    def _fail(self, batch: _Batch, exc: BaseException) -> None:
        if batch.failed:
            return
        batch.failed = True
        self._deliver(batch.pos, Failure(exc))

    def _deliver(self, pos: int, item: Any, way: tuple[float, float, Any] | None = None) -> None:
        """Put ``item`` on the ready queue in its turn; ``way``: a batch's read and assembly times, which
        go on ``stats.timeline`` as it is put (the consumer charges its waits to them)."""
        self.stats.batches_ready += 1
        if not self.plan.in_order:
            self._put(item, way)
            return
        self._reorder[pos] = (item, way)
        while self._next_pos in self._reorder:
            self._put(*self._reorder.pop(self._next_pos))
            self._next_pos += 1

    def _put(self, item: Any, way: tuple[float, float, Any] | None) -> None:
        if way is not None:  # before the batch: the consumer pops one entry per batch it takes
            self.stats.timeline.append(Timeline(way[0], way[1], time.perf_counter(), way[2]))
        self.out.put(item)
