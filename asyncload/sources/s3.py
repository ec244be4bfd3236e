"""Where an S3 object lives and how a request to it is signed: endpoint, region, credentials, URLs.

Why one small class: the Deep Lake probe, the object-store source's listing and its reads all need the
same answers (which endpoint, which keys, path-style URL, signed headers), resolved the same way Deep
Lake resolves them: a ``creds`` mapping with Deep Lake's key names first, then the standard ``AWS_*``
environment variables. No credentials at all means anonymous (unsigned) requests, for public buckets.

The secret key is held only inside :class:`~asyncload.sigv4.Credentials` (hidden from its repr) and is
never put in a URL, a message or a repr.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..sigv4 import EMPTY_SHA256, Credentials, SigV4Signer, query_string, quote_key

DEFAULT_REGION = "us-east-1"


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` → ``("bucket", "a/b")``; raises ``ValueError`` when there is no bucket."""
    if not url.startswith("s3://"):
        raise ValueError(f"not an s3:// URL: {url!r}")
    bucket, _, prefix = url[len("s3://") :].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {url!r}: expected s3://BUCKET/PREFIX")
    return bucket, prefix.strip("/")


class S3Endpoint:
    """An S3-compatible service and the identity used with it; builds path-style URLs and signs them."""

    def __init__(self, endpoint_url: str, region: str = DEFAULT_REGION, credentials: Credentials | None = None) -> None:
        self.endpoint_url = endpoint_url.rstrip("/")
        self.region = region
        self.credentials = credentials
        self._signer = SigV4Signer(credentials, region) if credentials else None

    @classmethod
    def resolve(cls, creds: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None) -> S3Endpoint:
        """From Deep Lake-style ``creds`` (``aws_access_key_id``, ``aws_secret_access_key``,
        ``aws_session_token``, ``endpoint_url``, ``aws_region``), falling back to ``AWS_*`` variables."""
        env = os.environ if env is None else env
        c = dict(creds or {})

        def pick(key: str, *names: str) -> str | None:
            if c.get(key):
                return str(c[key])
            for n in names:
                if env.get(n):
                    return env[n]
            return None

        region = pick("aws_region", "AWS_REGION", "AWS_DEFAULT_REGION") or DEFAULT_REGION
        endpoint = (
            pick("endpoint_url", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL") or f"https://s3.{region}.amazonaws.com"
        )
        access = pick("aws_access_key_id", "AWS_ACCESS_KEY_ID")
        secret = pick("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY")
        token = pick("aws_session_token", "AWS_SESSION_TOKEN")
        if bool(access) != bool(secret):
            raise ValueError("S3 credentials need both aws_access_key_id and aws_secret_access_key (one is missing)")
        creds_obj = Credentials(access, secret, token) if access and secret else None
        return cls(endpoint, region, creds_obj)

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

    def __repr__(self) -> str:
        who = "anonymous" if self.credentials is None else "signed"
        return f"S3Endpoint({self.endpoint_url!r}, region={self.region!r}, {who})"

    def __reduce__(self) -> tuple[object, ...]:
        return (S3Endpoint, (self.endpoint_url, self.region, self.credentials))
