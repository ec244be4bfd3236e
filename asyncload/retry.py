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
- **Counted.** :class:`RetryStats` counts attempts, retries, give-ups and causes, so a run that only
  succeeded thanks to retries shows it (``source.retry_stats()``).

Defaults (``RetryPolicy()``): 10 attempts, backoff ceilings 0.1 s doubling to a 5 s cap (9 sleeps: ~11 s
expected, ~21 s at most), at most 60 s per request; budget 1,000 retries, refilled by 0.1 per success.
A store restart of a few seconds is ridden out; a store that is gone fails an epoch within about 20 s,
sooner once the budget runs out (1,000 retries is ~8 rounds of 128 requests in flight).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from .errors import portable

T = TypeVar("T")

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
        self, what: str, attempts: int, last: BaseException, *, permanent: bool, budget_exhausted: bool = False
    ) -> None:
        self.what = what
        self.attempts = attempts
        self.last = last
        self.permanent = permanent
        self.budget_exhausted = budget_exhausted
        if permanent:
            why = "not retryable"
        elif budget_exhausted:
            why = "the source's retry budget is exhausted"
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
        return _give_up, (self.what, self.attempts, portable(self.last), self.permanent, self.budget_exhausted)


def _give_up(what: str, attempts: int, last: BaseException, permanent: bool, budget_exhausted: bool) -> GiveUp:
    return GiveUp(what, attempts, last, permanent=permanent, budget_exhausted=budget_exhausted)


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
    if isinstance(exc, (aiohttp.ClientSSLError, aiohttp.InvalidURL)):
        return False  # a certificate or a URL does not fix itself
    return isinstance(
        exc,
        (
            ConnectionError,
            TimeoutError,  # asyncio.TimeoutError is TimeoutError since 3.11
            aiohttp.ClientConnectionError,  # refused, reset, disconnected, socket timeouts
            aiohttp.ClientPayloadError,  # body cut short
        ),
    )


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


@dataclass(frozen=True)
class RetryPolicy:
    """How one source retries. Immutable and picklable; the budget and counters live on the source."""

    max_attempts: int = 10
    base_delay: float = 0.1
    max_delay: float = 5.0
    max_elapsed: float = 60.0
    max_retry_after: float = 10.0
    budget: float = 1000.0
    refill_per_success: float = 0.1

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts={self.max_attempts!r}: must be >= 1")
        if self.base_delay < 0 or self.max_delay < 0 or self.max_elapsed <= 0:
            raise ValueError("RetryPolicy delays must be >= 0 and max_elapsed > 0")
        if self.budget < 0 or self.refill_per_success < 0:
            raise ValueError("RetryPolicy.budget and refill_per_success must be >= 0")

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
    ) -> T:
        """Await ``attempt()`` until it succeeds or the policy gives up (then raise :class:`GiveUp`).

        ``attempt`` must build a fresh request each time (new signature, new connection if needed).
        Cancellation is never retried: it propagates at once, including out of a backoff sleep.
        """
        stats._add(requests=1)
        start = time.monotonic()
        tries = 0
        while True:
            tries += 1
            stats._add(attempts=1)
            try:
                result = await attempt()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                stats._cause(exc)
                if not transient(exc):
                    stats._add(gave_up=1)
                    raise GiveUp(what, tries, exc, permanent=True) from exc
                delay = self.backoff(tries, exc)
                if tries >= self.max_attempts or time.monotonic() - start + delay > self.max_elapsed:
                    stats._add(gave_up=1)
                    raise GiveUp(what, tries, exc, permanent=False) from exc
                if not budget.take():
                    stats._add(gave_up=1, budget_exhausted=1)
                    raise GiveUp(what, tries, exc, permanent=False, budget_exhausted=True) from exc
                stats._add(retries=1)
                await asyncio.sleep(delay)
                continue
            budget.success()
            return result
