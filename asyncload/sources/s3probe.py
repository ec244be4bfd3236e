"""A fast, signed look at an S3 bucket before a store is opened: is it there, and may we list it?

Why: Deep Lake retries an unreachable endpoint for ~42 s (and a missing bucket for over a minute) before
failing with ``curlCode: 7``, and says nothing about which setting is wrong. One signed ``ListObjectsV2``
(``max-keys=1``) under the dataset's prefix, with a deadline of a few seconds, tells the cases apart:

- nothing answers (refused, reset, timeout)   → :class:`S3EndpointError` (also a ``ConnectionError``)
- 403 with a signature/key error or a denial  → :class:`S3AccessError` (also a ``PermissionError``)
- 404 ``NoSuchBucket``                        → :class:`S3BucketNotFoundError` (a ``DatasetNotFoundError``)

Every message names the endpoint and the bucket, never the secret. Without credentials (anonymous
requests, or credentials Deep Lake finds by other means) a 403 proves nothing, so only reachability and
a missing bucket are judged. Listing is what Deep Lake does first when it opens a dataset, so a probe
that passes asks for no permission the store did not need anyway.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import DatasetNotFoundError, SourceError
from ..retry import GiveUp, RetryBudget, RetryPolicy, RetryStats, describe
from ._http import HTTPStatusError, Timeouts, new_session, request_bytes
from ._perloop import run_blocking
from .s3 import S3Endpoint, split_s3_url

#: Error codes that mean "these credentials are not accepted" rather than "this is forbidden".
_CREDENTIAL_CODES = frozenset(
    {
        "SignatureDoesNotMatch",
        "InvalidAccessKeyId",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
    }
)


class S3EndpointError(SourceError, ConnectionError):
    """The S3 endpoint did not answer (down, refused, unreachable, too slow)."""


class S3AccessError(SourceError, PermissionError):
    """The S3 endpoint refused the credentials, or denied access to the bucket."""


class S3BucketNotFoundError(DatasetNotFoundError):
    """The bucket does not exist at the endpoint."""


def _probe_policy(deadline: float) -> RetryPolicy:
    # A refused connection is retried briefly (a server a moment from listening), never for long.
    return RetryPolicy(max_attempts=3, base_delay=0.1, max_delay=0.5, max_elapsed=deadline, budget=10)


async def probe_bucket_async(
    s3: S3Endpoint,
    bucket: str,
    prefix: str = "",
    *,
    deadline: float = 5.0,
    verify_tls: bool | str = True,
    what: str = "",
) -> None:
    """Raise a :class:`SourceError` subclass unless the bucket answers a (signed) list within ``deadline`` s."""
    where = f"bucket {bucket!r} at S3 endpoint {s3.endpoint_url}" + (f" (for {what})" if what else "")
    query = {"list-type": "2", "max-keys": "1"}
    if prefix:
        query["prefix"] = prefix.rstrip("/") + "/"
    url = s3.url(bucket, query=query)
    timeouts = Timeouts(connect=min(2.0, deadline), read=deadline, total=deadline)
    policy = _probe_policy(deadline)
    async with new_session(1, timeouts, verify_tls) as session:

        async def attempt() -> bytes:
            return await request_bytes(session, "GET", url, s3.headers("GET", url), allow_redirects=False)

        try:
            await policy.call(attempt, what=f"listing {where}", budget=RetryBudget(10, 0), stats=RetryStats())
        except GiveUp as g:
            err = _classify(g, s3, bucket, where, deadline)
            if err is not None:
                raise err from None


def _classify(g: GiveUp, s3: S3Endpoint, bucket: str, where: str, deadline: float) -> SourceError | None:
    last = g.last
    if isinstance(last, HTTPStatusError):
        if last.status == 404 and last.code in ("NoSuchBucket", None):
            return S3BucketNotFoundError(f"{where}: the bucket does not exist ({describe(last)})")
        if last.status == 403 or last.code in _CREDENTIAL_CODES:
            if not s3.signed:
                return None  # anonymous: a denial proves nothing about the credentials used later
            if last.code in _CREDENTIAL_CODES:
                return S3AccessError(
                    f"{where} rejected the credentials ({describe(last)}): check aws_access_key_id / "
                    "aws_secret_access_key (or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) and aws_region"
                )
            return S3AccessError(f"{where}: access denied when listing the bucket ({describe(last)})")
        return SourceError(f"{where} answered {describe(last)} to a list request (after {g.attempts} attempts)")
    return S3EndpointError(
        f"{where} is unreachable: {describe(last)} (after {g.attempts} attempts within {deadline:.0f}s)"
    )


def probe_bucket(
    s3: S3Endpoint,
    bucket: str,
    prefix: str = "",
    *,
    deadline: float = 5.0,
    verify_tls: bool | str = True,
    what: str = "",
) -> None:
    """Blocking :func:`probe_bucket_async`, usable from any thread (runs on a private loop)."""
    err: SourceError | None = None
    try:
        run_blocking(
            lambda: probe_bucket_async(s3, bucket, prefix, deadline=deadline, verify_tls=verify_tls, what=what),
            timeout=deadline + 2.0,
            what=f"probing bucket {bucket!r} at {s3.endpoint_url}",
        )
    except SourceError as exc:
        err = exc
    except TimeoutError as exc:
        err = S3EndpointError(f"bucket {bucket!r} at S3 endpoint {s3.endpoint_url} is unreachable: {exc}")
    if err is not None:
        raise err


def probe_s3_url(
    url: str, creds: Mapping[str, str] | None = None, *, deadline: float = 5.0, verify_tls: bool | str = True
) -> None:
    """Probe the bucket of ``s3://bucket/prefix`` with ``creds`` (or ``AWS_*``); see the module docstring."""
    bucket, prefix = split_s3_url(url)
    try:
        s3 = S3Endpoint.resolve(creds)
    except ValueError as exc:
        raise SourceError(f"cannot open {url}: {exc}") from None
    probe_bucket(s3, bucket, prefix, deadline=deadline, verify_tls=verify_tls, what=url)
