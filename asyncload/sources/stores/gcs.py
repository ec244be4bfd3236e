"""Google Cloud Storage for the object-store source: ``gs://bucket/prefix`` over GCS's JSON API.

Why the JSON API on our own aiohttp session rather than google-cloud-storage or obstore: the reads share
the source's pool, timeouts, retry policy and error types with S3 and Azure (one behaviour to test and
tune), google-cloud-storage is synchronous (a thread per request), and obstore's GCS client speaks the
XML API, which the emulator published on PyPI (``gcp-storage-emulator``) does not serve completely
(measured: its GET lacks ``Last-Modified`` and obstore refuses the answer), so it could not be tested
here against a real server. The JSON API is what Google's own clients use.

Credentials, the standard way (:func:`~._creds.gcs_token`): ``creds={"token": ...}`` (a bearer token
used as is), a service-account key mapping (``type: service_account``), else google-auth's application
default credentials (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's ADC file, workload identity federation,
the metadata server), renewed before expiry; ``creds={"anonymous": "true"}`` for public data.
``STORAGE_EMULATOR_HOST`` (the variable Google's clients read) or ``creds["endpoint_url"]`` points at
another endpoint; the emulator variable alone means anonymous requests, as Google's clients send them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from .creds import Renewing, gcs_token
from .http import HTTPStatusError
from .store import Store, split_url

GCS_ENDPOINT = "https://storage.googleapis.com"


def split_gs_url(url: str) -> tuple[str, str]:
    """``gs://bucket/a/b/`` → ``("bucket", "a/b")``; raises ``ValueError`` when there is no bucket."""
    return split_url(url, "gs")


def _emulator(env: Mapping[str, str]) -> str | None:
    host = env.get("STORAGE_EMULATOR_HOST")
    if not host:
        return None
    return host if "://" in host else f"http://{host}"


class GCSBucket(Store):
    """One GCS bucket: JSON API listing and ``alt=media`` downloads, bearer-token authorisation."""

    kind = "GCS"

    def __init__(self, bucket: str, endpoint: str = GCS_ENDPOINT, token: Renewing[str] | str | None = None) -> None:
        self._bucket = bucket
        self._endpoint = endpoint.rstrip("/")
        self._token = token
        self._b = quote(bucket, safe="")

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def bucket(self) -> str:
        return self._bucket

    @property
    def signed(self) -> bool:
        return self._token is not None

    def object_url(self, key: str) -> str:
        return f"{self._endpoint}/download/storage/v1/b/{self._b}/o/{quote(key, safe='')}?alt=media"

    async def headers(self, method: str, url: str) -> Mapping[str, str] | None:
        token = self._token
        if token is None:
            return None
        value = token if isinstance(token, str) else await token.get()
        return {"Authorization": f"Bearer {value}"}

    def list_url(self, prefix: str, token: str | None, page: int) -> str:
        q = f"prefix={quote(prefix, safe='')}&maxResults={page}&fields=items(name),nextPageToken"
        if token:
            q += f"&pageToken={quote(token, safe='')}"
        return f"{self._endpoint}/storage/v1/b/{self._b}/o?{q}"

    def parse_list(self, body: bytes) -> tuple[list[str], str | None]:
        doc = json.loads(body)
        return [str(item["name"]) for item in doc.get("items", [])], doc.get("nextPageToken") or None

    def parse_tags(self, body: bytes) -> dict[str, str]:
        items = json.loads(body).get("items", [])
        tags = {str(i["name"]): f"{i.get('etag') or i.get('md5Hash')}/{i.get('size')}" for i in items}
        return {k: v for k, v in tags.items() if not v.startswith("None/")}

    def bucket_missing(self, err: HTTPStatusError) -> bool:
        return err.status == 404

    def credential_hint(self) -> str:
        what = self._token.what if isinstance(self._token, Renewing) else "creds['token']"
        return f"credentials from {what}; check GOOGLE_APPLICATION_CREDENTIALS or creds"

    def __repr__(self) -> str:
        return f"GCSBucket({self._bucket!r}, endpoint={self._endpoint!r}, signed={self.signed})"


def resolve_gcs(url: str, creds: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> GCSBucket:
    """The bucket of ``gs://bucket/prefix`` with its endpoint and credentials (see the module docstring).
    Blocking (the chain may read files or ask the metadata server): call it off the event loop."""
    env = os.environ if env is None else env
    bucket, _ = split_gs_url(url)
    c = dict(creds or {})
    endpoint = c.pop("endpoint_url", None) or _emulator(env) or GCS_ENDPOINT
    if c.get("token"):
        return GCSBucket(bucket, endpoint, str(c["token"]))
    if c.get("type") == "service_account":
        return GCSBucket(bucket, endpoint, gcs_token(c))
    if str(c.get("anonymous", "")).lower() in ("1", "true", "yes") or (_emulator(env) and not creds):
        return GCSBucket(bucket, endpoint, None)  # public data, or an emulator (as Google's clients do)
    renewing = gcs_token(None)
    renewing.get_blocking()  # fail at open if the chain has nothing
    return GCSBucket(bucket, endpoint, renewing)
