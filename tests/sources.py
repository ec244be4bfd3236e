"""Test sources: real Deep Lake reads behind a controlled delay (a user-defined Source, as users write them)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import threading
import time
from collections.abc import Callable

import numpy as np

from asyncload import DeepLakeSource, Source, SourceError
from asyncload.sources.base import Columns


class DelayedSource(DeepLakeSource):
    """Reads a real Deep Lake dataset, each request delayed by ``delay(indices)`` seconds on the loop.

    Counts requests in flight, so tests can check the loader's bounds from the store's side.
    """

    def __init__(self, url: str, delay: Callable[[list[int]], float], **kw) -> None:
        super().__init__(url, **kw)
        self.delay = delay
        self.in_flight = 0
        self.max_in_flight = 0
        self.max_samples_in_flight = 0
        self._samples = 0

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        self.in_flight += 1
        self._samples += len(indices)
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self.max_samples_in_flight = max(self.max_samples_in_flight, self._samples)
        try:
            await asyncio.sleep(self.delay(indices))
            return await super().read(indices, raw)
        finally:
            self.in_flight -= 1
            self._samples -= len(indices)


class RecordingSource(DeepLakeSource):
    """A real Deep Lake read that logs each request's indices to the file ``log``, so that a test sees the
    requests wherever they run (the default reader process: in-process Deep Lake reads are what the
    suite keeps to a minimum, see docs/ARCHITECTURE.md's crash table)."""

    def __init__(self, url: str, log: str | os.PathLike[str], **kw) -> None:
        super().__init__(url, **kw)
        self.log = str(log)

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        with open(self.log, "a") as f:
            f.write(json.dumps(list(indices)) + "\n")
        return await super().read(indices, raw)

    @property
    def reads(self) -> list[list[int]]:
        """Every request logged so far, in the order they were made."""
        try:
            with open(self.log) as f:
                return [json.loads(line) for line in f]
        except FileNotFoundError:
            return []

    def forget(self) -> None:
        """Start the log again."""
        open(self.log, "w").close()


class HandleLog(DeepLakeSource):
    """A real Deep Lake source that logs each open and close of its handle (``open <pid>``, ``close <pid>``) to
    the file ``log``, so that a test sees the handles a process it cannot reach holds (the node's reader)."""

    def __init__(self, url: str, log: str | os.PathLike[str], **kw) -> None:
        super().__init__(url, **kw)
        self.log = str(log)

    def _note(self, what: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"{what} {os.getpid()}\n")

    def _open(self):
        handle = super()._open()
        self._note("open")
        return handle

    def _close_handle(self, handle) -> None:
        self._note("close")
        super()._close_handle(handle)

    def count(self, what: str, pid: int) -> int:
        """Lines ``what <pid>`` logged so far."""
        try:
            with open(self.log) as f:
                return sum(1 for line in f if line.split() == [what, str(pid)])
        except FileNotFoundError:
            return 0


class FailingSource(DeepLakeSource):
    """A store where some samples cannot be read: a request containing any of ``bad`` fails with
    ``OSError``, as a real store fails a whole ranged GET when part of it is unreadable."""

    def __init__(self, url: str, bad: set[int], **kw) -> None:
        super().__init__(url, **kw)
        self.bad = set(bad)

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        hit = sorted(self.bad.intersection(indices))
        if hit:
            raise OSError(f"unreadable object for sample {hit[0]}")
        return await super().read(indices, raw)


class CapacitySource(DeepLakeSource):
    """A store that serves ``slots`` requests at a time, each taking ``latency`` seconds: throughput
    grows with concurrency up to ``slots / latency`` and is flat beyond (Little's law). Above
    ``throttle_above`` requests in flight it answers like S3's 503 SlowDown: counted as throttling,
    and the request is served late."""

    def __init__(self, url: str, slots: int, latency: float, throttle_above: int | None = None, **kw) -> None:
        super().__init__(url, **kw)
        self.slots, self.latency, self.throttle_above = slots, latency, throttle_above
        self.throttled = 0
        self.in_flight = 0
        self._sem = None

    def __getstate__(self):
        return {**super().__getstate__(), "_sem": None}

    def throttle_count(self) -> int:
        return self.throttled

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem[0] is not loop:  # one loop per epoch
            self._sem = (loop, asyncio.Semaphore(self.slots))
        self.in_flight += 1
        try:
            if self.throttle_above is not None and self.in_flight > self.throttle_above:
                self.throttled += 1
                await asyncio.sleep(4 * self.latency)
            async with self._sem[1]:
                await asyncio.sleep(self.latency)
            return await super().read(indices, raw)
        finally:
            self.in_flight -= 1


class StragglerSource(DeepLakeSource):
    """Every ``every``-th request (counted in this process) stalls ``stall`` seconds: a straggler, as one
    slow connection or overloaded server makes one request in many."""

    def __init__(self, url: str, every: int, stall: float, **kw) -> None:
        super().__init__(url, **kw)
        self.every, self.stall = every, stall
        self.count = 0
        self.in_flight = 0
        self.stalled = 0

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        self.count += 1
        self.in_flight += 1
        try:
            if self.count % self.every == 0 and self.count > 100:
                self.stalled += 1
                await asyncio.sleep(self.stall)
            else:
                await asyncio.sleep(0.005)
            return await super().read(indices, raw)
        finally:
            self.in_flight -= 1


class CrashingSource(DeepLakeSource):
    """Reads a real Deep Lake dataset, but a read that includes one of ``rows`` kills the process that runs
    it with ``sig``, as Deep Lake's failing-read bug does, only in a reader process (never in the process
    that made the source, the test's own). With ``once_dir``, each row kills only the first reader that
    reads it (a marker file per row); without it, every reader that reads it."""

    def __init__(self, url: str, rows, sig: int = signal.SIGSEGV, once_dir: str | None = None, **kw) -> None:
        super().__init__(url, **kw)
        self.rows = frozenset(int(r) for r in rows)
        self.sig = int(sig)
        self.once_dir = once_dir
        self.owner = os.getpid()

    def _kills(self, row: int) -> bool:
        return row in self.rows and (self.once_dir is None or self._first(f"row-{row}"))

    def _first(self, marker: str) -> bool:
        """Whether this process is the first to come here: it made ``marker`` in ``once_dir``."""
        try:
            os.close(os.open(os.path.join(str(self.once_dir), marker), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True

    def _die(self) -> None:
        """Kill this process with ``sig``, leaving no core file: ``make test`` allows cores so that a real
        crash of the suite is explained."""
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
        os.kill(os.getpid(), self.sig)

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        if os.getpid() != self.owner and any(self._kills(i) for i in indices):
            self._die()
            await asyncio.sleep(30)  # the signal ends the process before this does
        return await super().read(indices, raw)


class CrashingOpen(CrashingSource):
    """A ``CrashingSource`` whose open kills the first reader process that opens it (``once_dir``'s marker
    ``open``), before that reader has said what it opened: the training process, which does not open it,
    must wait for the next reader's open."""

    def _open(self):
        if os.getpid() != self.owner and self._first("open"):
            self._die()
        return super()._open()


class UnsendableDescription(DeepLakeSource):
    """A source whose open learns something that cannot be pickled: the reader's description of it cannot
    be sent to the training process."""

    learned_at_open = ("_rows", "_branch", "_learned_lock")

    def _open(self):
        handle = super()._open()
        self._learned_lock = threading.Lock()
        return handle


class SilentOpen(DeepLakeSource):
    """A source whose open never returns in a reader process (a store that accepts the connection and says
    nothing, before the reader could say what it opened); in the process that made it, it opens as usual."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.owner = os.getpid()

    def _open(self):
        if os.getpid() != self.owner:
            time.sleep(3600)
        return super()._open()


class ExpiringSource(CrashingSource):
    """A ``CrashingSource`` whose access can be handed to one reader process only: the next
    ``reader_copy`` fails, as a credential chain that can no longer renew its keys does."""

    copies = 0

    def reader_copy(self) -> DeepLakeSource:
        self.copies += 1
        if self.copies > 1:
            raise SourceError(f"cannot renew the credentials for {self.url}")
        return super().reader_copy()


# -- sources written before ``read`` took ``raw`` (``read(self, indices)``), as users' subclasses were -------
class OldArraySource(Source[np.ndarray]):
    """A plain custom source of the old signature: ``rows`` rows of ``x`` (row ``i`` is ``[3i, 3i+1, 3i+2]``),
    read in the process that reads (no reader process: nothing in it can crash)."""

    def __init__(self, rows: int = 50, url: str = "memory://old-array") -> None:
        super().__init__(url, ("x",))
        self.rows = rows

    def _open(self) -> np.ndarray:
        return np.arange(self.rows * 3, dtype=np.int64).reshape(self.rows, 3)

    def _length(self, handle: np.ndarray) -> int:
        return len(handle)

    async def read(self, indices):  # noqa: ANN001, ANN201 - the old signature, as written then
        return {"x": self.handle()[indices]}


class OldCrashingSource(CrashingSource):
    """A ``CrashingSource`` whose ``read`` has the old signature: it kills its reader on ``rows`` and
    decodes every column itself (``super().read(indices)``)."""

    async def read(self, indices):  # noqa: ANN001, ANN201
        return await super().read(indices)


class Rows(Source[None]):
    """Rows that are their own numbers (column ``x``), no store: what a test of orders, resumes and ranks
    needs to see. ``block``: the source's ``block_rows``; ``delay``: seconds each read takes (a slow store)."""

    def __init__(self, n: int, block: int = 1, delay: float = 0.0) -> None:
        super().__init__("rows://x", ("x",))
        self.n, self.block, self.delay = n, block, delay

    def _open(self) -> None:
        return None

    def _length(self, handle: None) -> int:
        return self.n

    def _version(self, handle: None) -> str:
        return "v1"

    @property
    def local(self) -> bool:
        return True

    @property
    def block_rows(self) -> int:
        return self.block

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        if self.delay:
            await asyncio.sleep(self.delay)
        return {"x": np.asarray(indices, dtype=np.int64)}


class NotForTheNodeReader(DeepLakeSource):
    """A real Deep Lake dataset whose unpickling fails in the node's shared reader only (``nodeserver``), as a
    source of the user's could fail where its module cannot be imported: every other process reads it."""

    def __setstate__(self, state: dict) -> None:
        import sys

        if "asyncload.processes.nodeserver" in sys.modules:
            raise RuntimeError("this source is not read by the node's reader")
        super().__setstate__(state)
