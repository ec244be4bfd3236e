"""Reads of a source in a reader process the loader owns: what makes a native crash survivable.

Deep Lake 4.7.4 segfaults now and then while delivering a failed read (docs/deeplake_failing_read.py).
``IsolatedSource`` wraps such a source: the training process keeps the whole pipeline (fetchers, hedging,
the byte budget, decoding into the batch, ordering), and only ``read(indices, raw)`` crosses to a persistent
reader process, which runs the wrapped source's ``read`` on its own event loop and answers with what it
returned: stored bytes for the columns the loader decodes itself, arrays for the others. What crosses is
the store's bytes, not batches, so no shared memory is allocated per batch and decoding stays on the
training process's CPU pool, where it is when nothing is isolated.

::

    loop thread ── ("read", rid, indices, raw) ─▶ reader process: source.read on its loop ─▶ sender thread
         ▲                                                                                         │
         └── future settled ◀── receiver thread (one per reader) ◀── ("done"|"failed", rid, …) ────┘

Requests go down the pipe as ``Connection`` messages. Answers come up the same socket in frames of their
own (``_write_frame``): pickled with protocol 5, every stored-bytes sample and array out of band, written
with one gather write and read with one read into one buffer, so that a sample is copied once on each side
(into the socket, out of it) and arrives as a read-only view of that buffer, which the decoders take as
they take ``bytes``.

When the reader dies (EOF on its pipe), the receiver thread reaps it, starts a new one at once, and fails
every read it held with ``_Died``. Those reads, the *suspects*, are read again one at a time while every
other read waits, so that a second death names its request; a request that kills the reader while alone
is narrowed down by halves (``recovery.narrow``) until the rows that kill two fresh readers alone are
found: ``ReaderCrashError`` names them all (``on_error="skip"`` leaves them out), and they are never read
again. When the reader stops answering (a store that accepts connections and goes silent: Deep Lake sets
no deadline and its reads cannot be cancelled), the receiver thread, which wakes every tick while it
waits, kills it once its oldest read has had no answer for the policy's limit, and its reads are sent
again to the new reader as they were. What each costs (``max_restarts`` for deaths, ``stall_timeout``
for one outage), the backoff between replacements, and the errors: ``recovery``, shared with the fan-out.

Every piece of state is behind one lock: reads come from an epoch's loop thread, deaths from a receiver
thread, ``close`` from the consumer. Futures belong to the loop that made them and are settled with
``call_soon_threadsafe``; the epoch that made them has awaited them all before it ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import importlib
import logging
import multiprocessing
import os
import pickle
import queue
import select
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..engine.protocol import Failure
from ..engine.stats import Stats
from ..errors import LoaderClosedError, ReaderCrashError, StallError, WorkerError
from ..runtime.gather import write_all
from ..runtime.loop import ExitOrder, LoopThread, on_exit, start_thread
from ..runtime.procs import kill_processes, reap_process, run_child, start_child
from ..sources.base import Columns, Description, Source
from ..sources.mixed import Composition, composition_of
from .nodereader import Launch, NodeReader, NodeUnavailable, handshake, launch
from .recovery import Alone, Ended, Recovery, beat_interval, drive_async, read_limit

if TYPE_CHECKING:
    from ..image.codecs import ImageColumn

log = logging.getLogger("asyncload")


class _Died(Exception):
    """The reader ended (died, or was killed stuck) with this read in flight (never leaves this module)."""

    def __init__(self, ended: Ended) -> None:
        super().__init__(ended.how)
        self.ended = ended


@dataclass
class _Request:
    fut: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    indices: list[int]
    sent: float = field(default_factory=time.monotonic)


@dataclass
class _Reader:
    """One live reader process, the parent's end of its pipe and the thread that reads that end. ``proc``
    is a ``NodeReader`` where the reader is the node's, shared with the node's other loaders (``nodereader``)."""

    proc: BaseProcess | NodeReader
    conn: Connection
    stopping: bool = False
    thread: threading.Thread | None = field(default=None, repr=False)
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # when it said it had imported what it reads with (its store not yet asked)
    stuck_since: float | None = None  # set when it was killed for not answering: the store silent since then
    #: ``(pid, exitcode)`` once joined and released, by whichever comes first: its receiver thread handling
    #: its death (``_died``) or a stop (``_stop_reader``); ``end_lock`` makes that one of them, once
    ended: tuple[int | None, int | None] | None = None
    end_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: why the node's shared reader would not take this source (it lives on for the node's other loaders)
    refused: str | None = None

    def reap(self, how: Callable[[], tuple[int | None, int | None]]) -> tuple[int | None, int | None]:
        """Join and release the process once (``how`` does it), whichever thread asks first."""
        with self.end_lock:
            if self.ended is None:
                self.ended = how()
            return self.ended


#: Seconds a new reader may take to import Deep Lake and say it is ready before its reads' clock runs
#: anyway (a start is this machine's work, not the store's; it is not meant to take this long).
_START_ALLOWANCE = 30.0
#: Seconds an idle reader asked to stop may take to exit before it is killed (see ``runtime.procs.kill_processes``).
_STOP_GRACE = 0.5


def _settle(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], outcome: Any, failed: bool = False) -> None:
    """From any thread: complete ``fut`` on its own loop (dropped if that loop is closed, or if ``fut`` is
    done: its awaiting task was cancelled when an epoch stopped past its timeout)."""

    def done() -> None:
        if fut.done():
            return
        if failed:
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:
        pass


def _stop_reader(holder: list[_Reader | None], timeout: float, busy: Mapping[int, Any] | bool = False) -> None:
    """The finaliser (it must not hold the source): ask the live reader to exit, kill it if it has not
    within ``_STOP_GRACE``, or at once when it is ``busy`` with reads (it holds nothing of the user's; a
    reader stuck in a read of a silent store would never exit), and join its receiver thread."""
    r, holder[0] = holder[0], None
    if r is None:
        return
    r.stopping = True
    try:
        r.conn.send(None)
    except OSError:
        pass
    node = r.proc
    if isinstance(node, NodeReader):  # the node's: it goes on serving the others, and exits after the last
        r.reap(node.leave)
        if r.thread is not None and r.thread is not threading.current_thread():
            r.thread.join(timeout)
        r.conn.close()
        return

    def kill() -> tuple[int | None, int | None]:
        pid = r.proc.pid
        kill_processes([r.proc], 0.0 if busy else _STOP_GRACE)  # its exit closes the pipe: the receiver thread ends
        return pid, None

    r.reap(kill)
    if r.thread is not None and r.thread is not threading.current_thread():
        r.thread.join(timeout)
    r.conn.close()


class IsolatedSource(Source[Any]):
    """``inner``, read in a reader process (see the module doc). Everything but ``read`` is answered in this
    process: for a source that ``describes`` itself, from what the reader's open of it said (``Description``:
    length, version, columns, a query's rows), so that this process never opens the store; for any other,
    by ``inner``, opened here.
    ``needs_main``: ``inner`` pickled names the user's ``__main__`` (its class is defined in the script),
    which the reader must then import (``runtime.procs.start_child``). ``max_restarts``: deaths per epoch that are
    survived; ``stall_timeout``: seconds one outage of the store may last (``recovery``). ``node_root``: the
    node store's root, where the node's shared reader is found or started (``nodereader``); None: a reader
    process of this source's own."""

    def __init__(
        self,
        inner: Source[Any],
        *,
        needs_main: bool,
        context: str = "spawn",
        max_restarts: int = 3,
        timeout: float = 10.0,
        stall_timeout: float = 120.0,
        node_root: Path | None = None,
    ) -> None:
        super().__init__(inner.url, inner.columns)
        #: where the node's shared reader is; None once it failed this source (it reads in its own from then on)
        self._node_root = None if needs_main else node_root
        #: reads run in this process: a daemonic one (a DataLoader worker), which may not start a reader of
        #: its own, whose shared reader could not be reached or ended
        self._here = False
        #: ``start(early=True)``'s connection to the node's reader, until ``_join_node`` completes it
        self._launched: concurrent.futures.Future[tuple[Connection, NodeReader]] | None = None
        self.inner = inner
        self._context = context
        self._max_restarts = max_restarts
        self._stall_timeout = stall_timeout
        self._timeout = timeout
        self._needs_main = needs_main  # the pickled ``inner`` names ``__main__``: the reader must import it
        self._lock = threading.Lock()
        self._holder: list[_Reader | None] = [None]  # the live reader; a list so the finaliser can clear it
        self._rid = 0
        self._inflight: dict[int, _Request] = {}
        self._suspects = 0  # reads held by a reader that died, not yet read again alone
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []  # until no suspects
        self._alone = False  # a read is in flight alone: its reader's death is not charged
        self._alone_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._policy = Recovery(self.url, max_restarts=max_restarts, stall_timeout=stall_timeout)
        self._last_answer = 0.0  # monotonic time of the last answer of any reader
        self._fatal: WorkerError | StallError | None = None
        self._stats: Stats | None = None
        self._crashers: dict[int, Ended] = {}  # position → how the readers it killed alone ended
        self._counts = (0, 0)  # (retries, throttles) as the reader last reported them
        self._configured: tuple[int, int | None] | None = None
        self._epoch_began = 0.0  # monotonic time the current epoch began (``begin_epoch``)
        #: what the first reader's open of ``inner`` said: a ``Description``, or the ``Failure`` it met
        self._opened: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._finalizer = on_exit(self, ExitOrder.WORKERS, _stop_reader, self._holder, timeout, self._inflight)

    # -- what ``inner`` answers in this process --------------------------------------------------
    def _open(self) -> Any:
        """The reader's ``Description`` of ``inner``, adopted by ``inner``; ``inner`` opened here where it does
        not describe itself or where this process reads it (``_here``)."""
        described = self._description() if self.inner.describes else None
        if described is None:
            return self.inner.open()
        self.inner.adopt(described)
        return described

    def _description(self) -> Description | None:
        """Wait for the live reader's open of ``inner`` (started now if none runs) and return what it said;
        raise what that open raised. None where this process reads ``inner`` itself. A reader that dies
        opening is replaced as any death (``_died``), and the next one's open answers; one that says
        nothing within a start's allowance and ``stall_timeout`` is stopped and a ``StallError`` raised."""
        limit = _START_ALLOWANCE + self._stall_timeout
        began = time.monotonic()
        while True:
            with self._lock:
                if self._fatal is not None:
                    raise self._fatal
                if self._live() is None:
                    return None
            try:
                got = self._opened.result(timeout=0.05)
                break
            except concurrent.futures.TimeoutError:
                if time.monotonic() - began > limit:
                    self.close()
                    raise StallError(
                        f"asyncload: the reader process did not open {self.url} within {limit:.0f} s (a start's "
                        f"{_START_ALLOWANCE:.0f} s and stall_timeout={self._stall_timeout:g})",
                        source=self.url,
                        waited_s=time.monotonic() - began,
                    ) from None
        if isinstance(got, Failure):
            raise got.raise_in(f"the reader process that opened {self.url}")
        if not isinstance(got, Description):
            raise WorkerError(
                f"asyncload: the reader process for {self.url} answered its open with {type(got).__name__}"
            )
        return got

    def _described(self) -> Description | None:
        """The reader's ``Description`` of ``inner`` (this source opened now if it is not), or None."""
        handle = self.handle()
        return handle if isinstance(handle, Description) else None

    def _length(self, handle: Any) -> int:
        return len(self.inner)

    @property
    def version(self) -> str | None:
        self.handle()  # (adopted by ``inner`` at the open)
        return self.inner.version

    @property
    def identity(self) -> str | None:
        self.handle()
        return self.inner.identity

    @property
    def local(self) -> bool:
        return self.inner.local

    @property
    def store_key(self) -> str | None:
        d = self._described()
        return d.store_key if d is not None else self.inner.store_key

    def value_tag(self, column: str) -> str:
        d = self._described()
        return d.value_tags.get(column, "") if d is not None else self.inner.value_tag(column)

    def row_ids(self, positions: list[int]) -> list[int]:
        self.handle()  # (a query's rows adopted by ``inner`` at the open)
        return self.inner.row_ids(positions)

    def composition(self) -> Composition | None:
        """A mixture's composition (``MixedSource``), so the sampler orders its epochs here as it would."""
        return composition_of(self.inner)

    @property
    def preferred_read_mode(self) -> Literal["row", "column"]:
        d = self._described()
        return d.read_mode if d is not None else self.inner.preferred_read_mode

    @property
    def block_rows(self) -> int:
        return self.inner.block_rows

    def image_columns(self) -> Mapping[str, ImageColumn]:
        d = self._described()
        return d.image_columns if d is not None else self.inner.image_columns()

    def retry_count(self) -> int:
        return self._counts[0]

    def start_s(self) -> float | None:
        """Seconds the live reader took from its start to ready (its imports; the store not yet asked), or
        None while it starts or when none is running."""
        r = self._holder[0]
        return None if r is None or r.ready_at is None else r.ready_at - r.started

    def throttle_count(self) -> int:
        return self._counts[1]

    def configure(self, requests_in_flight: int, samples_in_flight: int | None = None) -> None:
        with self._lock:
            self._configured = (requests_in_flight, samples_in_flight)
            r = self._holder[0]
            if r is not None:
                self._send(r, ("configure", *self._configured))

    def set_stall_timeout(self, seconds: float) -> None:
        """The loader's ``stall_timeout``: the policy here (stuck readers, the outage's deadline) and the
        wrapped source, both in this process and in the reader (where ``inner`` reads: an object store's
        breaker bounds its waits by it), so that every layer gives a silent store the same deadline."""
        self.inner.set_stall_timeout(seconds)
        with self._lock:
            self._stall_timeout = float(seconds)
            self._policy.stall_timeout = self._stall_timeout
            self._policy.base_limit = read_limit(self._stall_timeout)
            r = self._holder[0]
            if r is not None:
                self._send(r, ("stall_timeout", self._stall_timeout))

    def outage(self) -> str | None:
        return self.inner.outage()

    # -- the reader's life -----------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """The live reader's pid (None before the first start and after ``close``)."""
        r = self._holder[0]
        return r.proc.pid if r is not None else None

    def start(self, early: bool = False) -> None:
        """Start the reader now, if none is live (the loader calls it at construction). ``early`` (before the
        loader's own open): the node's shared reader is connected to (started if none runs) and sent this
        source by a thread, so that the server's start and its open of the dataset overlap the loader's own
        open, as a reader of the loader's own does; the next call waits for it (``_join_node``)."""
        with self._lock:
            if early and self._holder[0] is None and self._node_root is not None and self._launched is None:
                try:
                    got, msg = self._launch_node(self._node_root)
                except NodeUnavailable as exc:
                    self._no_node(exc)
                    return
                self._launched = fut = concurrent.futures.Future()
                start_thread(_connect_node, got, msg, fut, name="asyncload-node-reader-connect")
                return
            self._live()

    def _launch_node(self, root: Path) -> tuple[Launch, tuple[str, str, bytes, list[str]]]:
        """A connection to the node's reader (``nodereader.launch``) and what it is sent first: this source as
        a reader process is given it (``reader_copy``: what this process checked, not checked again), pickled,
        with what imports it there. A failed check closes the connection."""
        got = launch(root, self.inner.reader_module)
        try:
            payload = ForkingPickler.dumps(self.inner.reader_copy())
        except BaseException:
            got.close()
            raise
        return got, ("source", self.inner.reader_module, bytes(payload), list(sys.path))

    def begin_epoch(self, stats: Stats) -> None:
        """A new epoch: its restarts and stalls are counted in ``stats`` and against a fresh budget; a
        reader stopped by ``close`` or by the last epoch's fatal error is started again (now, to overlap its
        start-up)."""
        with self._lock:
            self._stats, self._fatal = stats, None
            # Reads still in flight from an abandoned epoch are no clock of this one: a reader stuck in them
            # is judged, and an outage dated, from this epoch's start at the earliest.
            self._epoch_began = time.monotonic()
            # The epoch's pipeline watches these reads too (its watchdog): it says and counts the stalls
            # (``Stats.stalls``) and the policy here only replaces stuck readers, so that one outage is said
            # and counted once.
            self._policy = Recovery(
                self.url, max_restarts=self._max_restarts, stall_timeout=self._stall_timeout, stats=stats,
                report=False,
            )  # fmt: skip
            # Suspects of an epoch that stopped before reading them again (its loop is gone) wait no more.
            self._suspects, self._alone = 0, False
            waiters, self._waiters = self._waiters, []
            self._live()
        for loop, w in waiters:
            _settle(loop, w, None)

    def close(self) -> None:
        """Stop the reader now (killed if it does not exit at once: it holds nothing of the user's). Reads
        still in flight fail with ``LoaderClosedError``. A later read starts a new one."""
        with self._lock:
            holder = [self._holder[0]]
            self._holder[0] = None
            if self._launched is not None:  # connected early, never used: let the server go
                self._launched.add_done_callback(_drop_node)
                self._launched = None
            held = list(self._inflight.values())
            self._inflight.clear()
        _stop_reader(holder, self._timeout, bool(held))
        closed = LoaderClosedError(f"asyncload: the reader process for {self.url} was stopped by close()")
        for req in held:
            _settle(req.loop, req.fut, closed, True)

    def _live(self) -> _Reader | None:
        """The live reader, started if there is none (lock held); None where this process reads itself
        (``_spawn``)."""
        r = self._holder[0]
        if r is None and not self._here:
            self._spawn()
            r = self._holder[0]
        return r

    def _spawn(self) -> None:
        """Connect to the node's shared reader (``nodereader``), or start a reader of this source's own
        (lock held): one that cannot be reached, or that ended once, is not tried again."""
        daemon = multiprocessing.current_process().daemon
        if self._node_root is not None:
            try:
                self._join_node(self._node_root)
                return
            except NodeUnavailable as exc:
                self._no_node(exc)
        if daemon:  # may not start children: reads here from now on, as a worker without the node's reader does
            self._here = True
            return
        self._spawn_own()

    def _no_node(self, exc: NodeUnavailable) -> None:
        """The node's reader cannot be had: this source reads in a reader of its own from now on (lock held)."""
        where = "in this process (a DataLoader worker)" if multiprocessing.current_process().daemon else (
            "in a reader process of its own")  # fmt: skip
        # (the message, not the error: its traceback would hold this source in the log's records)
        level = logging.INFO if exc.said else logging.WARNING  # (said: the node store warns itself)
        log.log(level, "asyncload: %s reads %s: %s", self.url, where, str(exc))
        self._node_root = None

    def _join_node(self, root: Path) -> None:
        """Connect to the node's reader and send it this source, or wait for ``start(early=True)``'s thread
        that does (lock held). A failed check sends nothing: the reader has opened nothing for this source.
        The reader's answer comes to the receiver thread, not here: "ready", or "refused" (``_refused``)."""
        fut, self._launched = self._launched, None
        if fut is None:
            fut = concurrent.futures.Future()
            _connect_node(*self._launch_node(root), fut)
        conn, node = fut.result()  # (NodeUnavailable where it failed)
        self._started(_Reader(node, conn))

    def _spawn_own(self) -> None:
        """Start a reader (lock held). By spawn: a new interpreter that imports the source's module and Deep
        Lake and nothing of torch (``_procs``), in less time and memory than a fork of a server that preloaded
        torch. The source follows as its first message, once ``reader_copy`` has checked here what the
        reader need not check again (a bucket probe): that check overlaps the reader's imports, and the
        store's open overlaps this process's work. A failed check stops the reader it started."""
        proc, conn = start_child(self._context, _reader_main, (self.inner.reader_module,), name="asyncload-reader",
                                 needs_main=self._needs_main, quiet_blas=True)  # fmt: skip
        r = _Reader(proc, conn)
        try:
            checked = self.inner.reader_copy()
        except BaseException:
            _stop_reader([r], self._timeout)
            raise
        self._send(r, checked)  # a reader that died meanwhile is handled as any death, by its receiver thread
        self._started(r)

    def _started(self, r: _Reader) -> None:
        """``r`` has its source: configure it, make it the live reader and start its receiver (lock held)."""
        if self._configured is not None:
            self._send(r, ("configure", *self._configured))
        self._send(r, ("stall_timeout", self._stall_timeout))
        self._holder[0] = r
        # A weak reference: the thread must not keep the source alive (its GC is what stops the reader).
        r.thread = start_thread(_receive, weakref.ref(self), r, name="asyncload-reader-receive")

    @staticmethod
    def _send(r: _Reader, msg: object) -> None:
        try:
            r.conn.send(msg)
        except OSError:
            pass  # it is dying: its receiver thread sees the EOF and settles what it held

    def _tick(self) -> float:
        """How often the receiver thread looks for a stuck reader while it waits for answers."""
        return beat_interval(self._stall_timeout)

    def _answered(self, r: _Reader, kind: str, rid: int, payload: Any, counts: tuple[int, int]) -> None:
        now = time.monotonic()
        if kind == "ready":
            r.ready_at = now
            return
        if kind == "refused":  # the node's reader could not take the source; it hangs up next (``_died``)
            r.refused = str(payload)
            return
        # The first reader's open answers for this process (``_description``): what it said, or why what it
        # said could not be sent ("failed" with rid 0, which no read has: ``_send_all``).
        if kind == "opened" or (kind == "failed" and rid == 0):
            with self._lock:
                if not self._opened.done():
                    self._opened.set_result(payload)
            return
        self._counts = counts
        with self._lock:
            self._last_answer = now
            self._policy.answered(now)
            req = self._inflight.pop(rid, None)
        if req is not None:
            failed = kind == "failed"
            _settle(req.loop, req.fut, payload.exc if failed else payload, failed)

    def _watch(self, r: _Reader) -> None:
        """Every tick, from the receiver thread: kill ``r`` if it is stuck (``recovery``): its oldest read
        unanswered (counted from the reader's readiness, if that came later) is older than the policy's
        limit. Its receiver then sees the EOF and ``_died`` replaces it."""
        now = time.monotonic()
        with self._lock:
            if self._holder[0] is not r or r.stopping or r.stuck_since is not None or not self._inflight:
                return
            oldest = max(min(req.sent for req in self._inflight.values()), self._epoch_began)
            if r.ready_at is None:  # still starting: its imports are not the store's silence
                since = max(oldest, r.started)
                if now - since < _START_ALLOWANCE + self._policy.limit(since):
                    return
            else:
                since = max(oldest, r.ready_at)
                if not self._policy.stuck(since, now):
                    return
            r.stuck_since = max(oldest, self._last_answer)  # (``oldest`` is this epoch's at the earliest)
        r.proc.kill()

    def _died(self, r: _Reader) -> None:
        """Reap ``r``; replace it (a crash within the budget, or a stall within its deadline) and fail what
        it held with ``_Died``, or with the error that ends the epoch (``recovery``)."""
        node = r.proc
        if isinstance(node, NodeReader) and r.refused is not None:
            self._refused(r, node)
            return
        if isinstance(node, NodeReader):
            pid, exitcode = r.reap(functools.partial(node.reap, self._timeout))
        else:
            pid, exitcode = r.reap(functools.partial(reap_process, node, self._timeout))
        r.conn.close()
        now = time.monotonic()
        with self._lock:
            held = self._detach(r)
            if held is None:
                return
            rows = sorted(i for req in held for i in req.indices)
            name = f"reader process (pid {pid}) for {self.url}"
            note = None
            if isinstance(node, NodeReader):  # from now on this source reads in a reader of its own
                self._node_root = None
                name = f"the node's shared reader process (pid {pid}) for {self.url}"
                note = None if exitcode is not None else "ended (its exit status went to the loader that started it)"
            what = "reads of indices"
            policy = self._policy
            stalled = r.stuck_since is not None
            if r.stuck_since is not None:
                ended = Ended(pid, exitcode, stalled=True, silent_s=now - r.stuck_since)
                charged = False
                fatal: WorkerError | StallError | None = policy.stalled(r.stuck_since, rows, now)
            else:
                ended = Ended(pid, exitcode, note=note)
                charged = not self._alone
                fatal = policy.charge(name, ended, rows, what) if charged else None
            if fatal is None:
                try:
                    self._spawn()
                except Exception as exc:  # noqa: BLE001 - e.g. a credential chain that no longer renews
                    fatal = policy.fatal(
                        name, ended, rows, what, f"; no reader could replace it: {type(exc).__name__}: {exc}"
                    )
            error: BaseException
            if fatal is not None:
                self._fatal = error = fatal
                waiters, self._waiters = self._waiters, []
            else:
                if self._stats is not None:
                    self._stats.worker_restarts += 1
                if charged:  # a read alone is retried by ``_read_alone`` itself, already a suspect
                    self._suspects += len(held)
                error, waiters = _Died(ended), []
                policy.log_restart(name, ended, rows, what, self.pid, charged=charged or stalled)
        for req in held:
            _settle(req.loop, req.fut, error, True)
        for loop, w in waiters:
            _settle(loop, w, None)

    def _detach(self, r: _Reader) -> list[_Request] | None:
        """``r`` ended: it is no longer the live reader, and what it held is returned (lock held). None where
        ``close()`` came first (it took the live reader and failed what it held): a reader that ended as it
        was being stopped is not replaced, or the new one would outlive the loader."""
        if r.stopping or self._holder[0] is not r:
            return None
        self._holder[0] = None
        held = list(self._inflight.values())
        self._inflight.clear()
        return held

    def _refused(self, r: _Reader, node: NodeReader) -> None:
        """The node's reader would not take this source: read in a reader of this source's own from now
        on, the reads sent meanwhile sent to it as they were (nothing died: no restart is counted)."""
        r.reap(node.leave)
        r.conn.close()
        with self._lock:
            held = self._detach(r)
            if held is None:
                return
            self._node_root = None
            log.warning(
                "asyncload: the node's shared reader (pid %d) did not take %s (%s): it reads in %s",
                node.pid, self.url, r.refused,
                "this process" if multiprocessing.current_process().daemon else "a reader process of its own",
            )  # fmt: skip
            error: BaseException
            try:
                self._spawn()
                error = _Died(Ended(node.pid, None, stalled=True, note="did not take this source"))
            except Exception as exc:  # noqa: BLE001 - as for a replaced reader (``_died``)
                error = self._fatal = WorkerError(
                    f"asyncload: no reader process could read {self.url}: {type(exc).__name__}: {exc}"
                )
        for req in held:
            _settle(req.loop, req.fut, error, True)

    # -- reads -----------------------------------------------------------------------------------
    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        while True:
            try:
                return await self._ask(indices, raw, alone=False)  # (``raw`` goes with the request)
            except _Died as died:
                if not died.ended.stalled:
                    break  # read again below, alone; a stuck reader's reads are sent again as they were
        try:
            async with self._alone_gate():
                return await self._read_alone(indices, raw)
        finally:
            self._unsuspect()

    async def _read_alone(self, indices: list[int], cols: frozenset[str]) -> Columns:
        """Read ``indices`` with nothing else in flight; when that kills the reader, find the rows that do
        and raise ``ReaderCrashError`` naming them all (they are never read again). A death whose rows
        kill no reader when read again costs one restart, and the read is tried again
        (``Recovery.read_alone``)."""
        steps = self._policy.read_alone(
            indices, name=lambda pid: f"reader process (pid {pid}) for {self.url}", held="reads of indices",
            row_ids=self.inner.row_ids, found=self._found, lock=self._lock,
        )  # fmt: skip
        return await drive_async(steps, functools.partial(self._alone_step, cols=cols))  # type: ignore[no-any-return]

    async def _alone_step(self, ask: Alone, cols: frozenset[str]) -> Any:
        """One read that ``Recovery.read_alone`` asks for: its answer, or how the reader it killed ended. A
        probe that answers with an error answered: the reader lived."""
        try:
            return await self._alone_once(ask.rows, cols)
        except (WorkerError, StallError, LoaderClosedError):
            raise
        except Exception:  # noqa: BLE001 - for a probe, an answer: the reader lived
            if not ask.probe:
                raise
            return None

    def _found(self, bad: list[tuple[int, Ended]]) -> None:
        """Positions whose read kills a reader alone: never read again (``_ask`` names them at once)."""
        with self._lock:
            self._crashers.update(bad)

    async def _alone_once(self, indices: list[int], cols: frozenset[str]) -> Any:
        """One read of ``indices`` alone: its answer, or how the reader it killed ended (a reader stuck in it
        is no answer: it is read again in the new one)."""
        while True:
            try:
                return await self._ask(indices, cols, alone=True)
            except _Died as died:
                if not died.ended.stalled:
                    return died.ended

    async def _ask(self, indices: list[int], cols: frozenset[str], *, alone: bool) -> Any:
        """Send one read to the live reader and await its answer. A read that is not ``alone`` waits while
        suspects are being read again, so that those are alone."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._fatal is not None:
                    raise self._fatal
                known = [i for i in indices if i in self._crashers]
                if known:  # never read again (each read would kill a reader), also when found while waiting
                    raise self._crash_error(known)
                if alone or not self._suspects:
                    r = self._live()  # a new one after ``close()``
                    if r is None:
                        break
                    self._rid += 1
                    fut = loop.create_future()
                    self._inflight[self._rid] = _Request(fut, loop, indices)
                    self._alone = alone
                    self._send(r, ("read", self._rid, indices, cols))
                    break
                waiter = loop.create_future()
                self._waiters.append((loop, waiter))
            await waiter
        if r is None:  # (``_here``)
            return await self.inner.read(indices, cols)
        try:
            return await fut
        finally:
            if alone:
                with self._lock:
                    self._alone = False

    def _alone_gate(self) -> asyncio.Lock:
        """The lock that reads suspects again one at a time (one per loop: each epoch has its own)."""
        loop = asyncio.get_running_loop()
        if self._alone_lock is None or self._alone_lock[0] is not loop:
            self._alone_lock = (loop, asyncio.Lock())
        return self._alone_lock[1]

    def _unsuspect(self) -> None:
        with self._lock:
            self._suspects = max(0, self._suspects - 1)  # 0 already when a new epoch began
            waiters = []
            if not self._suspects:
                waiters, self._waiters = self._waiters, []
        for loop, w in waiters:
            _settle(loop, w, None)

    def _crash_error(self, positions: list[int]) -> ReaderCrashError:
        rows = self.inner.row_ids(sorted(positions))
        return self._policy.crash_error(rows, [self._crashers[p] for p in sorted(positions)])

    def __repr__(self) -> str:
        return f"IsolatedSource({self.inner!r})"


def _connect_node(got: Launch, msg: object, fut: concurrent.futures.Future[tuple[Connection, NodeReader]]) -> None:
    """Complete a connection to the node's reader (``nodereader.handshake``: it waits for a server still
    starting) and send it the source; the outcome into ``fut``. Holds nothing of the source's (a thread of
    ``start(early=True)`` must not keep it alive)."""
    try:
        conn, node = handshake(got)
        try:
            conn.send(msg)
        except OSError:
            pass  # it is ending: the receiver thread will see its EOF
        fut.set_result((conn, node))
    except BaseException as exc:  # noqa: BLE001 - the loader's to raise (``_join_node``)
        fut.set_exception(exc)


def _drop_node(fut: concurrent.futures.Future[tuple[Connection, NodeReader]]) -> None:
    """A connection made early and never used (the loader closed first): closed, the server left to others."""
    if fut.exception() is None:
        conn, node = fut.result()
        conn.close()
        node.leave()


# -- answers on the wire --------------------------------------------------------------------------
def _write_frame(fd: int, msg: tuple[Any, ...]) -> None:
    """Write ``msg`` as one frame: ``u32 n``, ``n`` sizes (``u64``), then the pickle and its ``n - 1``
    out-of-band buffers. Stored bytes are wrapped as ``PickleBuffer`` (they would be copied into the
    pickle); numpy arrays go out of band by themselves under protocol 5."""
    kind, rid, payload, counts = msg
    if kind == "done":
        payload = {c: [pickle.PickleBuffer(v) if isinstance(v, bytes) else v for v in vals]
                   if isinstance(vals, list) else vals for c, vals in payload.items()}  # fmt: skip
    buffers: list[pickle.PickleBuffer] = []
    head = pickle.dumps((kind, rid, payload, counts), protocol=5, buffer_callback=buffers.append)
    parts = [memoryview(head), *(b.raw() for b in buffers)]
    sizes = struct.pack(f"<I{len(parts)}Q", len(parts), *(p.nbytes for p in parts))
    write_all(fd, [sizes, *parts])


def _read_exact(fd: int, n: int) -> bytearray:
    buf = bytearray(n)
    _read_into(fd, memoryview(buf))
    return buf


def _read_into(fd: int, view: memoryview) -> None:
    """Fill ``view`` from ``fd``."""
    got, n = 0, view.nbytes
    while got < n:
        k = os.readv(fd, [view[got:]])  # the GIL is released while it waits
        if not k:
            raise EOFError
        got += k


def _read_frame(fd: int) -> Any:
    """One frame of ``_write_frame``: its message, whose stored bytes are read-only views of one buffer.

    The body's buffer is left uninitialised (``numpy.empty``, not ``bytearray``, which zeroes it): every
    byte of it is read over at once, and zeroing ~4 MB a frame (fresh memory, while the decode stage keeps
    the frames before) made a frame's read cost 0.040 instead of 0.029 ms CPU per 121 KB PNG sample
    (benchmarks/results/cpu/)."""
    import numpy as np  # imported by the training process already: a dictionary lookup

    (n,) = struct.unpack("<I", _read_exact(fd, 4))
    sizes = struct.unpack(f"<{n}Q", _read_exact(fd, 8 * n))
    body = memoryview(np.empty(sum(sizes), np.uint8)).cast("B")
    _read_into(fd, body)
    parts, at = [], 0
    for size in sizes:
        parts.append(body[at : at + size])
        at += size
    return pickle.loads(parts[0], buffers=parts[1:])


def _receive(ref: weakref.ref[IsolatedSource], r: _Reader) -> None:
    """Receiver thread of reader ``r``: settle each answer's read; every tick, look for a reader stuck in
    its reads (``IsolatedSource._watch``, which kills it); at EOF, unless ``r`` was told to stop, handle its
    death. It ends with the reader: the source's stop (``close``, its GC, exit) ends that."""
    fd = r.conn.fileno()
    watched = time.monotonic()
    while True:
        src = ref()
        if src is None:
            return
        tick = src._tick()
        if time.monotonic() - watched >= tick:  # also while other reads answer: one may be stuck
            src._watch(r)
            watched = time.monotonic()
        del src
        try:
            readable, _, _ = select.select([fd], [], [], tick)
        except (OSError, ValueError):  # closed under us: the reader is being stopped
            break
        if not readable:
            continue
        try:
            answer = _read_frame(fd)
        except (EOFError, OSError):
            break
        src = ref()
        if src is None:
            return
        src._answered(r, *answer)
        # Neither may stay in this frame while it waits: a failed read's exception, once raised in the epoch,
        # holds the epoch's frames in its traceback, and through them the source, which would then outlive
        # its loader and keep its reader running.
        del src, answer
    src = ref()
    if src is not None and not r.stopping:
        src._died(r)


# -- in the reader process -----------------------------------------------------------------------
def _reader_main(conn: Connection, module: str, environ: dict[str, str]) -> None:
    """Entry point of a reader process (started by reference: a module-level name)."""
    run_child(environ, _serve_reads, conn, module)


def _answer(out: queue.SimpleQueue[Any], source: Source[Any], rid: int, f: concurrent.futures.Future[Any]) -> None:
    counts = (source.retry_count(), source.throttle_count())
    exc = f.exception()
    out.put(("failed", rid, Failure(exc), counts) if exc is not None else ("done", rid, f.result(), counts))


def _send_all(conn: Connection, out: queue.SimpleQueue[Any]) -> None:
    """The reader's sender thread: pickling and writing answers off the loop and the receiving thread."""
    fd = conn.fileno()
    while (msg := out.get()) is not None:
        try:
            _write_frame(fd, msg)
        except OSError:
            return
        except Exception as exc:  # noqa: BLE001 - an answer that does not pickle fails its read, not the reader
            _write_frame(fd, ("failed", msg[1], Failure(exc), msg[3]))


def _serve_requests(
    conn: Connection,
    source: Source[Any],
    lt: LoopThread,
    out: queue.SimpleQueue[Any],
    pending: set[concurrent.futures.Future[Any]],
    configure: Callable[[int, int | None], None],
) -> None:
    """Read what one loader asks, concurrently on ``lt``, until it says stop or hangs up: each read's answer
    goes to ``out`` (its sender thread), each read in flight is in ``pending`` until it ends (so that no Deep
    Lake read is left running at exit). Shared by a loader's own reader (``_serve_reads``) and the node's
    (``nodeserver``), whose ``configure`` sizes its source for every loader it serves."""
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        if msg[0] == "configure":
            configure(*msg[1:])
            continue
        if msg[0] == "stall_timeout":
            source.set_stall_timeout(msg[1])
            continue
        _, rid, indices, raw = msg
        f = lt.submit(source.read(indices, raw))
        pending.add(f)
        f.add_done_callback(pending.discard)
        f.add_done_callback(functools.partial(_answer, out, source, rid))


def open_described(source: Source[Any]) -> Description | Failure | None:
    """Open ``source`` in a reader process. For a source that ``describes`` itself: its ``Description``, or
    the ``Failure`` of its open, either sent to the training process, which answers the loader from it (it
    has not opened the source: ``IsolatedSource._description``). For any other, None: the training process
    opened it already, and a failure here is each read's to raise."""
    try:
        if source.describes:
            return source.describe()  # (which opens it)
        source.open()
    except Exception as exc:  # noqa: BLE001 - the training process's to raise
        return Failure(exc) if source.describes else None
    return None


def _serve_reads(conn: Connection, module: str) -> None:
    """Read what the parent asks, concurrently on this process's loop, until told to stop or orphaned. The
    source's module (Deep Lake) is imported before the source arrives, while the parent checks its access."""
    if module != "__main__":  # the user's script is imported by the preparation data, when it is needed
        importlib.import_module(module)
    try:
        source = conn.recv()
    except (EOFError, OSError):
        return
    if source is None:  # the parent's check failed: nothing was opened
        return
    lt = LoopThread("asyncload-reader-loop", cpu_workers=1)
    lt.start()
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    sender = start_thread(_send_all, conn, out, name="asyncload-reader-send")
    out.put(("ready", 0, None, (0, 0)))  # imports done: from now on a silence is the store's (``_watch``)
    pending: set[concurrent.futures.Future[Any]] = set()
    try:
        # Now, not at the first read: what it says answers the training process (``open_described``).
        described = open_described(source)
        if described is not None:
            out.put(("opened", 0, described, (0, 0)))
        _serve_requests(conn, source, lt, out, pending, source.configure)
    finally:
        concurrent.futures.wait(list(pending), timeout=30)  # never leave a Deep Lake read running
        lt.stop()
        source.close()
        out.put(None)
        sender.join(5)
