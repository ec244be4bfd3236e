"""A fast, signed look at an S3 bucket before a store is opened: is it there, and may we list it?

Why: Deep Lake retries an unreachable endpoint or a missing bucket for a long time before failing with
``curlCode: 7`` (figures: ``benchmarks/results/design_notes.md``), and says nothing about which setting
is wrong. One signed ``ListObjectsV2`` (``max-keys=1``) under the dataset's prefix, with a deadline of a
few seconds, tells the cases apart:

- nothing answers (refused, reset, timeout)   → :class:`S3EndpointError` (also a ``ConnectionError``)
- 403 with a signature/key error or a denial  → :class:`S3AccessError` (also a ``PermissionError``)
- 404 ``NoSuchBucket``                        → :class:`S3BucketNotFoundError` (a ``DatasetNotFoundError``)

Every message names the endpoint and the bucket, never the secret. Without credentials (anonymous
requests, or credentials Deep Lake finds by other means) a 403 proves nothing, so only reachability and
a missing bucket are judged. Listing is what Deep Lake does first when it opens a dataset, so a probe
that passes asks for no permission the store did not need anyway.

Credentials and region come the standard way (:func:`~.s3.resolve_s3`: ``creds``, then the chain with
``profile``/``AWS_PROFILE``). When no region is configured, the bucket's answer names it
(``x-amz-bucket-region``, sent by AWS on success and on a wrong-region refusal alike) and the probe
signs again for that region. ``enabled=False`` skips the request (for stores that do not allow listing,
or to save the round trip); the region is then the configured one or ``us-east-1``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import SourceError
from ...runtime.loop import run_blocking
from .s3 import S3Bucket, S3Endpoint, resolve_s3, split_s3_url
from .store import (  # noqa: F401 - the S3 errors are part of this module's interface
    BucketNotFoundError,
    S3AccessError,
    S3BucketNotFoundError,
    S3EndpointError,
    StoreAccessError,
    StoreEndpointError,
    probe_store,
)


async def probe_bucket_async(
    s3: S3Endpoint,
    bucket: str,
    prefix: str = "",
    *,
    deadline: float = 5.0,
    verify_tls: bool | str = True,
    what: str = "",
) -> S3Endpoint:
    """Raise a :class:`SourceError` subclass unless the bucket answers a (signed) list within ``deadline``
    s; the endpoint to use from now on (in the bucket's own region when it named one and none was set)."""
    store = await probe_store(S3Bucket(s3, bucket), prefix, deadline=deadline, verify_tls=verify_tls, what=what)
    assert isinstance(store, S3Bucket)
    return store.s3


def probe_bucket(
    s3: S3Endpoint,
    bucket: str,
    prefix: str = "",
    *,
    deadline: float = 5.0,
    verify_tls: bool | str = True,
    what: str = "",
) -> S3Endpoint:
    """Blocking :func:`probe_bucket_async`, usable from any thread (runs on a private loop)."""
    err: SourceError | None = None
    try:
        return run_blocking(
            lambda: probe_bucket_async(s3, bucket, prefix, deadline=deadline, verify_tls=verify_tls, what=what),
            timeout=deadline * 2 + 2.0,  # a second round when the bucket names another region
            what=f"probing bucket {bucket!r} at {s3.endpoint_url}",
        )
    except TimeoutError as exc:
        err = S3EndpointError(f"bucket {bucket!r} at S3 endpoint {s3.endpoint_url} is unreachable: {exc}")
    raise err


def probe_s3_url(
    url: str,
    creds: Mapping[str, str] | None = None,
    *,
    profile: str | None = None,
    enabled: bool = True,
    deadline: float = 5.0,
    verify_tls: bool | str = True,
) -> S3Endpoint:
    """Resolve the identity for ``s3://bucket/prefix`` (``creds``, else the chain with ``profile``) and
    probe its bucket unless ``enabled`` is False; the endpoint, in the bucket's region. See the module
    docstring."""
    bucket, prefix = split_s3_url(url)
    try:
        s3 = resolve_s3(creds, profile)
    except ValueError as exc:
        raise SourceError(f"cannot open {url}: {exc}") from None
    if not enabled:
        return s3
    return probe_bucket(s3, bucket, prefix, deadline=deadline, verify_tls=verify_tls, what=url)
