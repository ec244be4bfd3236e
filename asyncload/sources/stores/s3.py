"""Where an S3 object lives and how a request to it is signed: endpoint, region, credentials, URLs.

Why one small class: the Deep Lake probe, the object-store source's listing and its reads all need the
same answers (which endpoint, which keys, path-style URL, signed headers). :func:`resolve_s3` finds them
the standard way: a ``creds`` mapping with Deep Lake's key names first, then botocore's credential chain
(``AWS_*`` variables, shared config and credentials files with profiles, ``credential_process``, SSO,
web identity, container and instance metadata; see :mod:`._creds`), renewed before it expires. The region
is the configured one (``aws_region``, ``AWS_REGION``, the profile's) or, when none is, the bucket's own
answer (``x-amz-bucket-region``, read by the probe). No credentials at all means anonymous (unsigned)
requests, for public buckets.

The secret key is held only inside :class:`~asyncload.sources.stores.sigv4.Credentials` (hidden from its repr) and is
never put in a URL, a message or a repr.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import xml.etree.ElementTree as ET
from collections.abc import Mapping

from .creds import Renewing, aws_chain, aws_profile
from .http import HTTPStatusError
from .sigv4 import EMPTY_SHA256, Credentials, SigV4Signer, query_string, quote_key
from .store import Store, split_url

DEFAULT_REGION = "us-east-1"
log = logging.getLogger("asyncload")

#: Error codes that mean "these credentials are not accepted" rather than "this is forbidden".
CREDENTIAL_CODES = frozenset(
    {
        "SignatureDoesNotMatch",
        "InvalidAccessKeyId",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "InvalidClientTokenId",
        "AuthorizationHeaderMalformed",
    }
)


def _aws_endpoint(region: str) -> str:
    return f"https://s3.{region}.amazonaws.com"


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` → ``("bucket", "a/b")``; raises ``ValueError`` when there is no bucket."""
    return split_url(url, "s3")


class S3Endpoint:
    """An S3-compatible service and the identity used with it; builds path-style URLs and signs them.

    ``credentials``: fixed keys, a :class:`~._creds.Renewing` chain, or None (anonymous). ``region_pinned``:
    the region was configured (else the bucket's answer may replace it); ``default_endpoint``: the
    endpoint is AWS's regional one derived from the region (and moves with it).
    """

    def __init__(
        self,
        endpoint_url: str,
        region: str = DEFAULT_REGION,
        credentials: Credentials | Renewing[Credentials] | None = None,
        *,
        region_pinned: bool = True,
        default_endpoint: bool = False,
    ) -> None:
        self.endpoint_url = endpoint_url.rstrip("/")
        self.region = region
        self.region_pinned = region_pinned
        self.default_endpoint = default_endpoint
        self._renewing = credentials if isinstance(credentials, Renewing) else None
        self.credentials = credentials.get_blocking() if isinstance(credentials, Renewing) else credentials
        self._signer = SigV4Signer(self.credentials, region) if self.credentials else None

    @property
    def source(self) -> str:
        """Where the credentials come from (for messages): ``creds``, the chain's method, or anonymous."""
        if self._renewing is not None:
            return self._renewing.what
        return "anonymous" if self.credentials is None else "creds"

    def in_region(self, region: str) -> S3Endpoint:
        """The same identity in ``region`` (AWS's endpoint for it when the endpoint was derived)."""
        endpoint = _aws_endpoint(region) if self.default_endpoint else self.endpoint_url
        creds = self._renewing if self._renewing is not None else self.credentials
        return S3Endpoint(endpoint, region, creds, region_pinned=True, default_endpoint=self.default_endpoint)

    @classmethod
    def resolve(cls, creds: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None) -> S3Endpoint:
        """From Deep Lake-style ``creds`` (``aws_access_key_id``, ``aws_secret_access_key``,
        ``aws_session_token``, ``endpoint_url``, ``aws_region``), falling back to ``AWS_*`` variables only
        (no profiles, no chain: :func:`resolve_s3` is the standard way)."""
        env = os.environ if env is None else env
        c = dict(creds or {})

        def pick(key: str, *names: str) -> str | None:
            if c.get(key):
                return str(c[key])
            for n in names:
                if env.get(n):
                    return env[n]
            return None

        configured = pick("aws_region", "AWS_REGION", "AWS_DEFAULT_REGION")
        region = configured or DEFAULT_REGION
        endpoint = pick("endpoint_url", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        access = pick("aws_access_key_id", "AWS_ACCESS_KEY_ID")
        secret = pick("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY")
        token = pick("aws_session_token", "AWS_SESSION_TOKEN")
        if bool(access) != bool(secret):
            raise ValueError("S3 credentials need both aws_access_key_id and aws_secret_access_key (one is missing)")
        creds_obj = Credentials(access, secret, token) if access and secret else None
        return cls(
            endpoint or _aws_endpoint(region), region, creds_obj,
            region_pinned=configured is not None, default_endpoint=endpoint is None,
        )  # fmt: skip

    @property
    def signed(self) -> bool:
        return self._signer is not None

    def url(self, bucket: str, key: str = "", query: Mapping[str, str] | None = None) -> str:
        """The encoded, path-style URL of ``bucket``/``key`` (with a canonical ``query``)."""
        path = f"/{quote_key(bucket)}"
        if key:
            path += f"/{quote_key(key)}"
        q = f"?{query_string(query)}" if query else ""
        return f"{self.endpoint_url}{path}{q}"

    def headers(self, method: str, url: str, payload_hash: str = EMPTY_SHA256) -> dict[str, str]:
        """Headers for ``method url``: SigV4-signed when there are credentials (fresh date each call)."""
        if self._signer is None:
            return {}
        return self._signer.sign(method, url, payload_hash=payload_hash)

    async def fresh_headers(self, method: str, url: str, payload_hash: str = EMPTY_SHA256) -> dict[str, str]:
        """:meth:`headers`, after renewing the credentials (in a worker thread) when they are due."""
        if self._renewing is not None:
            current = await self._renewing.get()
            if current is not self.credentials:
                self.credentials, self._signer = current, SigV4Signer(current, self.region)
        return self.headers(method, url, payload_hash)

    def as_creds(self) -> dict[str, str]:
        """Deep Lake-style ``creds`` for what was resolved (keys as of now, region, endpoint), for handing
        a chain's result and the bucket's region to a client that reads ``creds`` only. Holds the secret."""
        out = {"endpoint_url": self.endpoint_url, "aws_region": self.region}
        c = self._renewing.get_blocking() if self._renewing is not None else self.credentials
        if c is not None:
            out |= {"aws_access_key_id": c.access_key, "aws_secret_access_key": c.secret_key}
            if c.session_token:
                out["aws_session_token"] = c.session_token
        return out

    def __repr__(self) -> str:
        who = "anonymous" if self.credentials is None else f"signed, {self.source}"
        return f"S3Endpoint({self.endpoint_url!r}, region={self.region!r}, {who})"

    def __reduce__(self) -> tuple[object, ...]:
        # A renewing chain is a live object of this process: a copy carries the keys it holds now.
        return (S3Endpoint, (self.endpoint_url, self.region, self.credentials))


_warned_no_chain = False


def _warn_no_chain() -> None:
    global _warned_no_chain
    _warned_no_chain = True
    log.warning(
        "asyncload: no S3 keys in creds or AWS_* variables, and botocore is not installed, so profiles, SSO, "
        "web identity and instance roles are not looked at; requests go unsigned. pip install 'torch-asyncload[s3]'"
    )


def resolve_s3(creds: Mapping[str, str] | None = None, profile: str | None = None) -> S3Endpoint:
    """The endpoint, region and credentials for ``creds`` / ``profile``, the standard way (see the module
    docstring). Blocking (the chain may read files or ask a metadata service): call it off the loop."""
    c = {k: v for k, v in (creds or {}).items() if v}
    env = os.environ
    if "aws_access_key_id" in c or "aws_secret_access_key" in c:
        return S3Endpoint.resolve(c)  # explicit keys: Deep Lake's precedence, no chain
    name = aws_profile(creds, profile)
    if name is None and importlib.util.find_spec("botocore") is None:
        # Without the s3 extra: the AWS_* variables only, as before the chain (said once, not per open).
        endpoint = S3Endpoint.resolve(c)
        if endpoint.credentials is None and not _warned_no_chain:
            _warn_no_chain()
        return endpoint
    renewing, chain_region, chain_endpoint = aws_chain(name)
    region = c.get("aws_region") or env.get("AWS_REGION") or chain_region
    endpoint = c.get("endpoint_url") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or chain_endpoint
    return S3Endpoint(
        endpoint or _aws_endpoint(region or DEFAULT_REGION), region or DEFAULT_REGION, renewing,
        region_pinned=region is not None, default_endpoint=endpoint is None,
    )  # fmt: skip


class S3Bucket(Store):
    """One bucket at an :class:`S3Endpoint`: path-style object URLs, ListObjectsV2, SigV4."""

    kind = "S3"

    def __init__(self, s3: S3Endpoint, bucket: str) -> None:
        self.s3 = s3
        self._bucket = bucket

    @property
    def endpoint(self) -> str:
        return self.s3.endpoint_url

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def signed(self) -> bool:
        return self.s3.signed

    def object_url(self, key: str) -> str:
        return self.s3.url(self._bucket, key)

    async def headers(self, method: str, url: str) -> Mapping[str, str] | None:
        return await self.s3.fresh_headers(method, url)

    def list_url(self, prefix: str, token: str | None, page: int) -> str:
        query = {"list-type": "2", "max-keys": str(page)}
        if prefix:
            query["prefix"] = prefix
        if token:
            query["continuation-token"] = token
        return self.s3.url(self._bucket, query=query)

    def parse_list(self, body: bytes) -> tuple[list[str], str | None]:
        root = ET.fromstring(body)
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        keys = [k.text or "" for k in root.iter(f"{ns}Key")]
        truncated = (root.findtext(f"{ns}IsTruncated") or "").strip().lower() == "true"
        return keys, (root.findtext(f"{ns}NextContinuationToken") if truncated else None) or None

    def parse_tags(self, body: bytes) -> dict[str, str]:
        root = ET.fromstring(body)
        ns = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
        out = {}
        for c in root.iter(f"{ns}Contents"):
            key, etag, size = c.findtext(f"{ns}Key"), c.findtext(f"{ns}ETag"), c.findtext(f"{ns}Size")
            if key and etag:
                out[key] = f"{etag.strip()}/{size}"
        return out

    def credentials_refused(self, err: HTTPStatusError) -> bool:
        return err.code in CREDENTIAL_CODES

    def bucket_missing(self, err: HTTPStatusError) -> bool:
        return err.status == 404 and err.code in ("NoSuchBucket", None)

    def credential_hint(self) -> str:
        return (
            f"credentials from {self.s3.source}; check aws_access_key_id / aws_secret_access_key (or "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE and the shared credentials file) and aws_region"
        )

    def rerouted(self, region: str | None) -> S3Bucket | None:
        if not region or region == self.s3.region or self.s3.region_pinned:
            return None
        return S3Bucket(self.s3.in_region(region), self._bucket)
