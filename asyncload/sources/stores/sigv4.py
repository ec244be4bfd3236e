"""AWS Signature Version 4 for S3 requests, with ``hmac`` and ``hashlib`` only.

Why our own signer rather than botocore's ``S3SigV4Auth`` or aiobotocore:

- on a small client the CPU per GET caps throughput, and this signer costs less per signature and per GET
  than botocore's signer, and far less than aiobotocore's request/response machinery, without importing
  botocore into every worker process (figures, per signature and per GET:
  ``benchmarks/results/design_notes.md``);
- aiobotocore would also bring its own session, pool and retries (to be configured around ours) and a
  pinned botocore range;
- S3 needs only the header form of SigV4 for GET/PUT/HEAD/LIST, which is small and is checked against
  AWS's published example (in the tests) and a real server that verifies signatures.

The URL given to :meth:`SigV4Signer.sign` must be the exact, already-encoded URL that will be sent (see
:func:`quote_key`); the signer signs what is sent and never re-encodes it.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import quote, urlsplit

#: ``x-amz-content-sha256`` of an empty body (GET, HEAD, LIST).
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
#: ``x-amz-content-sha256`` for a body that is not hashed (allowed by S3 over any transport).
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"


@dataclass(frozen=True)
class Credentials:
    """An access key pair (and optional session token). The secret never appears in a repr."""

    access_key: str
    secret_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.access_key or not self.secret_key:
            raise ValueError("Credentials need both an access key and a secret key")


def quote_key(key: str) -> str:
    """Encode an object key for a URL path the way S3 canonicalises it (``/`` kept, RFC 3986 otherwise)."""
    return quote(key, safe="/~")


def quote_param(value: str) -> str:
    """Encode a query name or value the way SigV4 canonicalises it (everything but unreserved)."""
    return quote(value, safe="~")


def query_string(params: Mapping[str, str]) -> str:
    """An encoded query string whose order is already canonical."""
    return "&".join(f"{quote_param(k)}={quote_param(v)}" for k, v in sorted(params.items()))


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


class SigV4Signer:
    """Signs requests for one credential set, region and service; derived keys are cached per day."""

    def __init__(self, credentials: Credentials, region: str, service: str = "s3") -> None:
        self.credentials = credentials
        self.region = region
        self.service = service
        self._keys: dict[str, bytes] = {}

    def __repr__(self) -> str:
        return f"SigV4Signer({self.credentials!r}, region={self.region!r}, service={self.service!r})"

    def _signing_key(self, day: str) -> bytes:
        key = self._keys.get(day)
        if key is None:
            k = _hmac(("AWS4" + self.credentials.secret_key).encode(), day)
            k = _hmac(k, self.region)
            k = _hmac(k, self.service)
            key = _hmac(k, "aws4_request")
            self._keys = {day: key}  # one day at a time; replacing the dict is atomic for other threads
        return key

    def sign(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | None = None,
        payload_hash: str = EMPTY_SHA256,
        now: _dt.datetime | None = None,
    ) -> dict[str, str]:
        """The headers to send with ``method url``: ``Host``, the ``x-amz-*`` ones, ``Authorization``.

        ``headers`` are extra headers to sign and send (for example ``Range``); ``url`` is sent as is.
        """
        parts = urlsplit(url)
        host = parts.netloc.lower()
        when = (now or _dt.datetime.now(_dt.UTC)).astimezone(_dt.UTC)
        amz_date = when.strftime("%Y%m%dT%H%M%SZ")
        day = amz_date[:8]
        out: dict[str, str] = {"Host": host, "x-amz-date": amz_date, "x-amz-content-sha256": payload_hash}
        if self.credentials.session_token:
            out["x-amz-security-token"] = self.credentials.session_token
        for k, v in (headers or {}).items():
            out[k] = v
        canon = sorted((k.lower(), " ".join(str(v).split())) for k, v in out.items())
        signed_headers = ";".join(k for k, _ in canon)
        if parts.query:
            pairs = [p.partition("=") for p in parts.query.split("&") if p]
            query = "&".join(f"{k}={v}" for k, _, v in sorted(pairs, key=lambda p: (p[0], p[2])))
        else:
            query = ""
        request = "\n".join(
            [
                method.upper(),
                parts.path or "/",
                query,
                "".join(f"{k}:{v}\n" for k, v in canon),
                signed_headers,
                payload_hash,
            ]
        )
        scope = f"{day}/{self.region}/{self.service}/aws4_request"
        to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, hashlib.sha256(request.encode()).hexdigest()])
        signature = hmac.new(self._signing_key(day), to_sign.encode(), hashlib.sha256).hexdigest()
        out["Authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={self.credentials.access_key}/{scope}, "
            f"SignedHeaders={signed_headers}, Signature={signature}"
        )
        return out
