"""Retrying remote reads: which failures are worth another try, how long to wait, and when to stop.

Why these rules:

- **Transient vs permanent.** A refused or reset connection, a timeout, HTTP 500/502/503/504, S3's
  ``SlowDown``/``InternalError``/``RequestTimeout`` and 429 are conditions that pass; 403, 404, a bad
  signature or any other 4xx will answer the same way next time, so they fail at once (retrying them
  only delays the error and hides the key that is wrong).
- **Exponential backoff with full jitter** (``sleep = uniform(0, min(cap, base * 2**n))``): when a store
  hiccups, hundreds of reads fail together; full jitter spreads their retries instead of sending them
  back in synchronized waves. ``Retry-After`` (on 429/503) is honoured, up to ``max_retry_after``.
- **Two limits.** ``max_attempts`` bounds one request (and ``max_elapsed`` its wall time, backoff
  included); the :class:`RetryBudget` bounds the whole source in this process. The budget is a token
  bucket: every retry takes a token, every success gives back ``refill_per_success``. During an outage the
  bucket drains and the remaining requests fail at once instead of multiplying the load of a store that
  is down (a retry storm); in a healthy run the bucket stays full.
- **One outage is one event** (:class:`Breaker`, one per source and process). Hundreds of reads are in
  flight; when the store restarts or goes silent they all fail together (refused, reset, timed out), and
  retrying each on its own spent the budget in two or three rounds: a 10 s restart ended the epoch. When
  ``trip_after`` connection failures (no HTTP answer) come in a row with no answer between them, the
  breaker opens: the failing reads, and every read that meets it, wait at the breaker instead of
  retrying, uncharged (neither an attempt nor a budget token). One of them at a time is the probe: it
  tries its own request again after ``probe_delay`` doubling to ``probe_max_delay``; the first answer that
  says the store serves (data, or a 4xx) closes the breaker and releases every waiting read. A 5xx or 429
  while it is open (a store that restarts listens before it serves: SeaweedFS answered 500 for seconds)
  keeps it open; while it is closed, 5xx are retried one by one against the budget as before. A waiting read gives up past ``max_outage`` (the loader sets it from ``stall_timeout``, whose
  watchdog normally ends the epoch first) with :class:`GiveUp` ``outage_s`` set. The closed breaker
  costs a read one attribute test.
- **The store can always prove it is back.** ``max_outage`` bounds how long *a read* waits, counted from
  when the breaker opened or when that read began, whichever is later; it never bounds the breaker. A read
  that arrives after an outage has outlasted ``max_outage`` (the epoch that waited for it ended in
  ``StallError``; a retried epoch, a new loader over the same source) is the next probe, not an instant
  failure: a store that answers again is read again, in the same process, for the life of the source.
- **A silence is bounded by the outage clock, not by the request's.** A request that meets no answer
  (timed out, refused, reset) is not charged ``max_attempts`` or ``max_elapsed`` when a breaker watches
  it (``trip_after`` > 0; with 0 there is no breaker and the request's own limits end it), even before the
  breaker opens (one or two silent reads in flight take ``trip_after`` timeouts to
  open it): it is retried until the store has been silent ``max_outage`` (then :class:`GiveUp` with
  ``outage_s``, a ``StallError``), so the user's ``stall_timeout`` is the one deadline a silent store
  meets, not a per-request budget that would end the read first as a plain ``TimeoutError``.
- **Counted.** :class:`RetryStats` counts attempts, retries, give-ups and causes, so a run that only
  succeeded thanks to retries shows it (``source.retry_stats()``), and the outages ridden out.

Defaults (``RetryPolicy()``): 10 attempts, backoff ceilings 0.1 s doubling to a 5 s cap (9 sleeps: ~11 s
expected, ~21 s at most), at most 60 s per request; budget 1,000 retries, refilled by 0.1 per success.
The breaker opens after 8 connection failures in a row and probes after 0.25 s, doubling to 2 s: a store
that restarts, or is silent for a while, is ridden out (within the loader's ``stall_timeout``). The budget
still ends a store that keeps failing requests while answering (500s): ~8 rounds of 128 requests.
"""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ...errors import portable

T = TypeVar("T")
log = logging.getLogger("asyncload")

#: HTTP statuses that describe a passing condition of the server or a proxy in front of it.
RETRYABLE_STATUS = frozenset({429, 500, 502, 503, 504})
#: S3 error codes that are transient whatever their HTTP status (``RequestTimeout`` comes as a 400).
RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "InternalError",
        "ServiceUnavailable",
        "RequestTimeout",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
    }
)


class GiveUp(Exception):
    """A request failed for good. ``attempts`` were made; ``last`` is the last failure (also ``__cause__``).

    ``permanent`` is True when the failure was not worth a retry, ``budget_exhausted`` when the
    source's retry budget stopped it.
    """

    def __init__(
        self, what: str, attempts: int, last: BaseException, *, permanent: bool, budget_exhausted: bool = False,
        outage_s: float | None = None,
    ) -> None:  # fmt: skip
        self.what = what
        self.attempts = attempts
        self.last = last
        self.permanent = permanent
        self.budget_exhausted = budget_exhausted
        self.outage_s = outage_s  # set when the store was away (breaker open) for longer than max_outage
        if permanent:
            why = "not retryable"
        elif budget_exhausted:
            why = "the source's retry budget is exhausted"
        elif outage_s is not None:
            why = f"the store has not answered for {outage_s:.1f} s"
        else:
            why = "out of attempts"
        plural = "s" if attempts != 1 else ""
        super().__init__(f"{what}: failed after {attempts} attempt{plural} ({why}); last cause: {describe(last)}")

    def as_builtin(self) -> BaseException:
        """A built-in exception type for the failure (so ``except FileNotFoundError`` works), this message:
        ``FileNotFoundError`` for 404, ``PermissionError`` for 401/403, ``TimeoutError`` for a timeout,
        ``ConnectionError`` for any other transient failure, else this ``GiveUp`` itself."""
        last = self.last
        status = getattr(last, "status", None)
        cause: BaseException
        if status == 404:
            cause = FileNotFoundError(str(self))
        elif status in (401, 403):
            cause = PermissionError(str(self))
        elif status is None and isinstance(last, TimeoutError):
            cause = TimeoutError(str(self))
        elif not self.permanent:
            cause = ConnectionError(str(self))
        else:
            return self
        cause.__cause__ = last
        return cause

    def __reduce__(self) -> tuple[Any, ...]:
        # The keyword-only flags are not in ``args``: rebuild from the fields so it crosses processes.
        return _give_up, (
            self.what, self.attempts, portable(self.last), self.permanent, self.budget_exhausted, self.outage_s
        )  # fmt: skip


def _give_up(
    what: str, attempts: int, last: BaseException, permanent: bool, budget_exhausted: bool,
    outage_s: float | None = None,
) -> GiveUp:  # fmt: skip
    return GiveUp(what, attempts, last, permanent=permanent, budget_exhausted=budget_exhausted, outage_s=outage_s)


def describe(exc: BaseException) -> str:
    """``Type: message`` of a failure, for error messages (an HTTP status error says ``HTTP 404 ...``)."""
    text = str(exc)
    if status_of(exc) is not None and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries, if any (``status`` attribute or aiohttp's response error)."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


def is_transient(exc: BaseException) -> bool:
    """True for failures that another attempt may not meet (see the module docstring)."""
    status = status_of(exc)
    if status is not None:
        return status in RETRYABLE_STATUS or getattr(exc, "code", None) in RETRYABLE_CODES
    aiohttp = sys.modules.get("aiohttp")  # (not imported: none of its errors can have been raised)
    if aiohttp is not None and isinstance(exc, (aiohttp.ClientSSLError, aiohttp.InvalidURL)):
        return False  # a certificate or a URL does not fix itself
    if isinstance(exc, (ConnectionError, TimeoutError)):  # asyncio.TimeoutError is TimeoutError since 3.11
        return True
    return aiohttp is not None and isinstance(
        exc,
        (
            aiohttp.ClientConnectionError,  # refused, reset, disconnected, socket timeouts
            aiohttp.ClientPayloadError,  # body cut short
        ),
    )


def is_outage(exc: BaseException) -> bool:
    """True for failures that say the store may be away (no HTTP answer at all: refused, reset, timed out),
    what the :class:`Breaker` counts; an HTTP status, even 503, is an answer."""
    # A body cut short (``ClientPayloadError``) came after the store's answer had begun: it is there.
    aiohttp = sys.modules.get("aiohttp")
    cut_short = aiohttp is not None and isinstance(exc, aiohttp.ClientPayloadError)
    return status_of(exc) is None and is_transient(exc) and not cut_short


def _cause_name(exc: BaseException) -> str:
    status = status_of(exc)
    if status is not None:
        code = getattr(exc, "code", None)
        return f"HTTP {status}" + (f" {code}" if code else "")
    return type(exc).__name__


class RetryStats:
    """Counters of one source in one process (thread-safe; read with :meth:`snapshot`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests = 0  # logical requests (each may take several attempts)
        self.attempts = 0
        self.retries = 0
        self.gave_up = 0
        self.budget_exhausted = 0
        self.outages = 0  # times the breaker opened (the store away), and closed again
        self.outage_s = 0.0  # seconds it was open, summed over the outages that ended
        self.outage_waits = 0  # failures that met an open breaker: waited for the store, not retried or charged
        self.causes: Counter[str] = Counter()  # failures seen, by cause, retried or not

    def _add(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                setattr(self, k, getattr(self, k) + v)

    def _cause(self, exc: BaseException) -> None:
        with self._lock:
            self.causes[_cause_name(exc)] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": self.requests,
                "attempts": self.attempts,
                "retries": self.retries,
                "gave_up": self.gave_up,
                "budget_exhausted": self.budget_exhausted,
                "outages": self.outages,
                "outage_s": self.outage_s,
                "outage_waits": self.outage_waits,
                "causes": dict(self.causes),
            }


class RetryBudget:
    """A token bucket of retries shared by every request of one source in one process."""

    def __init__(self, capacity: float, refill_per_success: float) -> None:
        self.capacity = capacity
        self.refill_per_success = refill_per_success
        self._tokens = capacity
        self._lock = threading.Lock()

    @property
    def tokens(self) -> float:
        return self._tokens

    def take(self) -> bool:
        """Take one retry token; False when the bucket is empty."""
        with self._lock:
            if self._tokens < 1.0:
                return False
            self._tokens -= 1.0
            return True

    def success(self) -> None:
        if self._tokens < self.capacity:  # racy read is fine: only skips a lock in the common case
            with self._lock:
                self._tokens = min(self.capacity, self._tokens + self.refill_per_success)


class Breaker:
    """The store is away: the reads of one source (in one process, on any loop) wait here as one instead
    of each retrying on its own (module docstring). Closed, it costs a read one attribute test
    (``is_open``); its state changes under a lock, and waiting reads are woken on their own loops."""

    def __init__(self, name: str, policy: RetryPolicy, stats: RetryStats, max_outage: float = 180.0) -> None:
        self.name = name  # the store, for log lines
        self.trip_after = policy.trip_after
        self.probe_delay = policy.probe_delay
        self.probe_max_delay = policy.probe_max_delay
        self.max_outage = max_outage
        self.is_open = False
        self.opened_at = 0.0
        self._stats = stats
        self._lock = threading.Lock()
        self._failures = 0  # connection failures in a row, with no answer between them
        self.last_answer = 0.0  # monotonic time of the store's last answer (data or any HTTP status)
        self.last: BaseException | None = None  # the last of them (for a stall's message)
        self._probing = False  # a read is the probe now
        self._probes = 0  # failed probes in this outage (the next probe's delay doubles with them)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def answered(self) -> None:
        """The store answered (data, or any HTTP status): it is there."""
        self.last_answer = time.monotonic()  # (one float store, no lock: read only to compare)
        if self._failures or self.is_open:  # (unlocked test: the common case takes no lock)
            with self._lock:
                self._failures = 0
                if self.is_open:
                    self.is_open = False
                    self._probing = False
                    away = time.monotonic() - self.opened_at
                    self._stats._add(outages=1)
                    with self._stats._lock:
                        self._stats.outage_s += away
                    log.info("asyncload: %s answers again after %.1f s away; %d reads resume", self.name, away,
                             len(self._waiters))  # fmt: skip
                    self._wake_all()

    def failed(self, probe: bool, exc: BaseException | None = None) -> bool:
        """A request met no answer (``is_outage``). True when the breaker is open (opened now, or before):
        the failure is the outage's, to be waited out here, not retried and charged on its own."""
        with self._lock:
            self.last = exc
            if probe:
                self._probing = False
                self._probes += 1
            self._failures += 1
            if not self.is_open and self.trip_after and self._failures >= self.trip_after:
                self.is_open = True
                self.opened_at = time.monotonic()
                self._probes = 0
                log.warning(
                    "asyncload: %s does not answer (%d requests in a row failed without an answer): reads wait "
                    "for it as one, probing it, for up to %.0f s", self.name, self._failures, self.max_outage,
                )  # fmt: skip
            if self.is_open:
                self._stats._add(outage_waits=1)
            return self.is_open

    async def wait(self, since: float | None = None) -> bool:
        """While open: wait for the store. Returns True when this read is to be the probe (try now), False
        when the breaker closed; raises ``TimeoutError`` once this read has waited ``max_outage``, counted
        from the breaker's opening or from ``since`` (when the read began), whichever is later: a read that
        comes after an outage outlasted ``max_outage`` probes the store instead of failing unsent."""
        loop = asyncio.get_running_loop()
        since = time.monotonic() if since is None else since
        while True:
            with self._lock:
                if not self.is_open:
                    return False
                left = max(self.opened_at, since) + self.max_outage - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{self.name} has not answered for {self.max_outage:.0f} s")
                probe = not self._probing
                if probe:
                    self._probing = True
                    delay = min(self.probe_max_delay, self.probe_delay * 2**self._probes)
                else:
                    fut = loop.create_future()
                    self._waiters.append((loop, fut))
            if probe:
                try:
                    await asyncio.sleep(min(delay, left))
                except BaseException:  # cancelled: another read must probe
                    self.release_probe()
                    raise
                return True
            try:
                await asyncio.wait_for(fut, left)
            except TimeoutError:
                continue  # (the check above raises)

    def release_probe(self) -> None:
        """The probe was cancelled before it answered: let another waiting read probe."""
        with self._lock:
            self._probing = False
            self._wake_all()

    def _wake_all(self) -> None:
        waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # that loop is closed: nobody waits there any more
                pass


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


@dataclass(frozen=True)
class RetryPolicy:
    """How one source retries (module docstring). Immutable and picklable; the budget, the breaker and
    the counters live on the source.

    ``max_attempts``, ``base_delay``, ``max_delay``, ``max_elapsed``, ``max_retry_after``: one request's
    retries (full-jitter backoff, ``Retry-After`` honoured up to ``max_retry_after``). ``budget``,
    ``refill_per_success``: the source's token bucket of retries. ``trip_after``: connection failures in a
    row that open the breaker (0: no breaker); ``probe_delay``, ``probe_max_delay``: the probe's backoff.
    """

    max_attempts: int = 10
    base_delay: float = 0.1
    max_delay: float = 5.0
    max_elapsed: float = 60.0
    max_retry_after: float = 10.0
    budget: float = 1000.0
    refill_per_success: float = 0.1
    trip_after: int = 8
    probe_delay: float = 0.25
    probe_max_delay: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts={self.max_attempts!r}: must be >= 1")
        if self.base_delay < 0 or self.max_delay < 0 or self.max_elapsed <= 0:
            raise ValueError("RetryPolicy delays must be >= 0 and max_elapsed > 0")
        if self.budget < 0 or self.refill_per_success < 0:
            raise ValueError("RetryPolicy.budget and refill_per_success must be >= 0")
        if self.trip_after < 0 or self.probe_delay < 0 or self.probe_max_delay < 0:
            raise ValueError("RetryPolicy.trip_after, probe_delay and probe_max_delay must be >= 0")

    def new_budget(self) -> RetryBudget:
        return RetryBudget(self.budget, self.refill_per_success)

    def backoff(self, retry: int, exc: BaseException | None = None, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based): full jitter, or ``Retry-After``."""
        after = getattr(exc, "retry_after", None) if exc is not None else None
        if isinstance(after, (int, float)) and after >= 0:
            return min(float(after), self.max_retry_after)
        ceiling = min(self.max_delay, self.base_delay * (2 ** (retry - 1)))
        return (rng or random).uniform(0.0, ceiling)

    async def call(
        self,
        attempt: Callable[[], Awaitable[T]],
        *,
        what: str,
        budget: RetryBudget,
        stats: RetryStats,
        transient: Callable[[BaseException], bool] = is_transient,
        breaker: Breaker | None = None,
    ) -> T:
        """Await ``attempt()`` until it succeeds or the policy gives up (then raise :class:`GiveUp`).

        ``attempt`` must build a fresh request each time (new signature, new connection if needed).
        Cancellation is never retried: it propagates at once, including out of a backoff sleep.
        With a ``breaker``, failures without an answer while it is open are waited out there, uncharged.
        """
        stats._add(requests=1)
        began = start = time.monotonic()
        tries = 0  # attempts made
        charged = 0  # ... that count against max_attempts (not those the breaker waited out, nor silences)
        probe = False
        last: BaseException | None = None
        while True:
            if breaker is not None and breaker.is_open:
                t_wait = time.monotonic()
                try:
                    probe = await breaker.wait(began)
                except TimeoutError as away:
                    stats._add(gave_up=1)
                    cause = last or breaker.last or away  # (a request that met the open breaker before any attempt)
                    outage = time.monotonic() - max(breaker.opened_at, began)
                    raise GiveUp(what, tries, cause, permanent=False, outage_s=outage) from cause
                start += time.monotonic() - t_wait  # max_elapsed counts this request's own time, not the outage's
            tries += 1
            charged += 1
            stats._add(attempts=1)
            sent = time.monotonic()
            try:
                result = await attempt()
            except asyncio.CancelledError:
                if probe and breaker is not None:
                    breaker.release_probe()
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                stats._cause(exc)
                last = exc
                if breaker is not None:
                    if is_outage(exc):
                        if breaker.failed(probe, exc):
                            probe = False
                            charged -= 1
                            continue
                    elif (status := status_of(exc)) is not None:  # an HTTP answer, now
                        if breaker.is_open and status in RETRYABLE_STATUS:  # up, not serving yet (a restart)
                            if breaker.failed(probe, exc):
                                probe = False
                                charged -= 1
                                continue
                        else:
                            breaker.answered()
                    elif probe:  # neither: let another read probe
                        breaker.release_probe()
                probe = False
                if not transient(exc):
                    stats._add(gave_up=1)
                    raise GiveUp(what, tries, exc, permanent=True) from exc
                if breaker is not None and breaker.trip_after and is_outage(exc) and breaker.last_answer < sent:
                    # The store answered nothing since this attempt was sent: its silence (one the breaker
                    # has not yet called an outage), bounded by the outage clock (``max_outage``, from the
                    # loader's stall_timeout), not by this request's attempts. A request that times out while
                    # the store answers others is this request's failure, charged below.
                    charged -= 1
                    delay = self.backoff(min(tries, 30), exc)
                    silent = time.monotonic() - max(breaker.last_answer, began)
                    if silent + delay > breaker.max_outage:
                        stats._add(gave_up=1)
                        raise GiveUp(what, tries, exc, permanent=False, outage_s=silent) from exc
                else:
                    delay = self.backoff(max(charged, 1), exc)
                    if charged >= self.max_attempts or time.monotonic() - start + delay > self.max_elapsed:
                        stats._add(gave_up=1)
                        raise GiveUp(what, tries, exc, permanent=False) from exc
                if not budget.take():
                    stats._add(gave_up=1, budget_exhausted=1)
                    raise GiveUp(what, tries, exc, permanent=False, budget_exhausted=True) from exc
                stats._add(retries=1)
                await asyncio.sleep(delay)
                continue
            if breaker is not None:
                breaker.answered()
            budget.success()
            return result
