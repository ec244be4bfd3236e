"""What the object-store source needs from a store (S3, GCS, Azure Blob, plain HTTP), and the open probe.

Why one small interface: the source's work is the same on every store (list a prefix or read a manifest,
GET every object with the retry policy, decode), and only four things differ: the object URL, how a
request is authorised, how a prefix is listed, and which answers mean "wrong credentials" or "no such
bucket". Each store is resolved in the process that reads (its credentials may be a live, renewing
chain) and is never pickled; the source pickles its description (URL, creds, profile) instead.

The probe: one authorised listing of one key under the prefix, with a deadline of a few seconds, before
anything else. A down endpoint, refused credentials and a missing bucket then fail in seconds with a
:class:`~asyncload.errors.SourceError` naming the endpoint and the bucket (never the secret), instead of
surfacing as the first read's error after the retry policy has run out.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Mapping

from ...errors import (  # noqa: F401 - the store errors are defined with the others; named here for the stores
    BucketNotFoundError,
    DatasetNotFoundError,
    S3AccessError,
    S3BucketNotFoundError,
    S3EndpointError,
    SourceError,
    StoreAccessError,
    StoreEndpointError,
)
from .http import HTTPStatusError, Timeouts, request_blocking
from .retry import GiveUp, RetryBudget, RetryPolicy, RetryStats, describe


def split_url(url: str, *schemes: str) -> tuple[str, str]:
    """``scheme://bucket/a/b/`` → ``("bucket", "a/b")`` for one of ``schemes``; ``ValueError`` otherwise."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in schemes:
        raise ValueError(f"not a {schemes[0]}:// URL: {url!r}")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}: expected {schemes[0]}://BUCKET/PREFIX")
    return bucket, prefix.strip("/")


class Store(abc.ABC):
    """One bucket (or container) of one store, with the identity used on it."""

    #: "S3", "GCS", "Azure Blob", "HTTP": for messages.
    kind: str = ""
    #: Whether a prefix can be listed (plain HTTP cannot).
    listable: bool = True

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """The endpoint URL, for messages."""

    @property
    @abc.abstractmethod
    def bucket(self) -> str:
        """The bucket or container name ("" for plain HTTP)."""

    @property
    def signed(self) -> bool:
        """Whether requests carry credentials (an anonymous 403 proves nothing about credentials)."""
        return False

    def where(self) -> str:
        noun = "container" if self.kind == "Azure Blob" else "bucket"
        return f"{noun} {self.bucket!r} at {self.kind} endpoint {self.endpoint}"

    @abc.abstractmethod
    def object_url(self, key: str) -> str:
        """The encoded URL of ``key`` (a key inside the bucket)."""

    async def headers(self, method: str, url: str) -> Mapping[str, str] | None:
        """Headers that authorise ``method url`` (renewing credentials off the loop when they are due)."""
        return None

    def list_url(self, prefix: str, token: str | None, page: int) -> str:
        """The URL of one listing page of the keys under ``prefix`` (``token``: the previous page's)."""
        raise NotImplementedError(f"{self.kind} cannot be listed")

    def parse_list(self, body: bytes) -> tuple[list[str], str | None]:
        """``(keys, next page's token or None)`` from a listing page."""
        raise NotImplementedError(f"{self.kind} cannot be listed")

    def parse_tags(self, body: bytes) -> dict[str, str]:
        """``{key: "<etag>/<size>"}`` from a listing page, where the listing gives them (what names an
        object's contents: the node block store's key); empty where it does not."""
        return {}

    def credentials_refused(self, err: HTTPStatusError) -> bool:
        """``err`` says the credentials themselves were not accepted (not merely denied access)."""
        return err.status == 401

    def bucket_missing(self, err: HTTPStatusError) -> bool:
        return err.status == 404

    def credential_hint(self) -> str:
        """What to check when the credentials are refused."""
        return "check the credentials"

    def rerouted(self, region: str | None) -> Store | None:
        """A copy that uses the bucket's own ``region`` when the store named one and it differs."""
        return None


class HTTPStore(Store):
    """A plain ``http(s)://`` prefix: anonymous GETs of ``<prefix>/<key>``, no listing."""

    kind = "HTTP"
    listable = False

    def __init__(self, base_url: str) -> None:
        self._base = base_url.rstrip("/")

    @property
    def endpoint(self) -> str:
        return self._base

    @property
    def bucket(self) -> str:
        return ""

    def object_url(self, key: str) -> str:
        from .sigv4 import quote_key

        return f"{self._base}/{quote_key(key)}"


def _probe_policy(deadline: float) -> RetryPolicy:
    # A refused connection is retried briefly (a server a moment from listening), never for long.
    return RetryPolicy(max_attempts=3, base_delay=0.1, max_delay=0.5, max_elapsed=deadline, budget=10)


async def probe_store(
    store: Store, prefix: str = "", *, deadline: float = 5.0, verify_tls: bool | str = True, what: str = ""
) -> Store:
    """List one key under ``prefix`` within ``deadline`` s; the store to use (rerouted to the bucket's own
    region when it named one), or a :class:`SourceError` subclass naming endpoint and bucket."""
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    timeouts = Timeouts(connect=min(2.0, deadline), read=deadline, total=deadline)

    async def attempt(s: Store) -> Mapping[str, str]:
        url = s.list_url(prefix, None, 1)
        signed = await s.headers("GET", url)
        # One request: the standard library's client, on a thread (``http.request_blocking`` says why).
        _, headers = await asyncio.to_thread(request_blocking, "GET", url, signed, timeouts, verify_tls)
        return headers

    for hop in range(2):  # a second try only when the bucket named another region
        try:
            headers = await _probe_policy(deadline).call(
                lambda s=store: attempt(s), what=f"listing {store.where()}", budget=RetryBudget(10, 0),
                stats=RetryStats(),
            )  # fmt: skip
        except GiveUp as g:
            region = getattr(g.last, "region", None)
            moved = store.rerouted(region) if hop == 0 else None
            if moved is not None:
                store = moved
                continue
            err = classify(g, store, what, deadline)
            if err is not None:
                raise err from None
            return store
        return store.rerouted(headers.get("x-amz-bucket-region")) or store
    return store


def classify(g: GiveUp, store: Store, what: str, deadline: float) -> SourceError | None:
    """The open error for a failed probe; None when the failure proves nothing (an anonymous denial)."""
    s3 = store.kind == "S3"
    where = store.where() + (f" (for {what})" if what else "")
    last = g.last
    if isinstance(last, SourceError):
        return last  # the credentials could not be fetched (a chain's own, clear error)
    if isinstance(last, HTTPStatusError):
        if store.bucket_missing(last):
            cls: type[SourceError] = S3BucketNotFoundError if s3 else BucketNotFoundError
            return cls(f"{where}: the {where.split()[0]} does not exist ({describe(last)})")
        refused = store.credentials_refused(last)
        if last.status in (401, 403) or refused:
            if not store.signed:
                return None  # anonymous: a denial proves nothing about the credentials used later
            cls = S3AccessError if s3 else StoreAccessError
            if refused:
                return cls(f"{where} rejected the credentials ({describe(last)}): {store.credential_hint()}")
            return cls(f"{where}: access denied when listing ({describe(last)})")
        return SourceError(f"{where} answered {describe(last)} to a list request (after {g.attempts} attempts)")
    cls = S3EndpointError if s3 else StoreEndpointError
    return cls(f"{where} is unreachable: {describe(last)} (after {g.attempts} attempts within {deadline:.0f}s)")
