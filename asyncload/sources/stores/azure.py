"""Azure Blob Storage for the object-store source: ``az://container/prefix`` (or ``azure://``) over the Blob
REST API on the source's own aiohttp session.

Why the REST API here rather than azure-storage-blob or obstore: the reads share the source's pool,
timeouts, retry policy and typed errors with S3 and GCS (one behaviour to test and tune); the Blob API
needs a GET per object and one list call per 5,000 keys, nothing more.

Credentials, the standard way, first found wins:

1. ``creds``: ``connection_string``, or ``account_key``, or ``sas_token`` (with ``account_name``);
2. the environment the Azure tools read: ``AZURE_STORAGE_CONNECTION_STRING``, ``AZURE_STORAGE_ACCOUNT_KEY``
   (or ``AZURE_STORAGE_KEY``), ``AZURE_STORAGE_SAS_TOKEN``, with ``AZURE_STORAGE_ACCOUNT_NAME`` (or
   ``AZURE_STORAGE_ACCOUNT``);
3. azure-identity's ``DefaultAzureCredential`` (service principal variables, workload identity, managed
   identity, the Azure CLI, ...): an OAuth token renewed before it expires (:mod:`._creds`).

An account key signs each request with Shared Key (HMAC-SHA256 over the request's canonical form, as
Azure specifies it); the key itself is never sent, logged or put in a repr. ``creds["endpoint_url"]``
or a connection string's ``BlobEndpoint`` names another endpoint (Azurite:
``http://127.0.0.1:10000/devstoreaccount1``).
"""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import os
import xml.etree.ElementTree as ET
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, urlsplit

from .creds import Renewing, azure_token
from .http import HTTPStatusError
from .store import Store, split_url

#: The Blob service version asked for (supported by Azure and by Azurite).
API_VERSION = "2021-08-06"
_REFUSED = frozenset({"AuthenticationFailed", "InvalidAuthenticationInfo", "NoAuthenticationInformation"})


def split_az_url(url: str) -> tuple[str, str]:
    """``az://container/a/b`` (or ``azure://``) → ``("container", "a/b")``."""
    return split_url(url, "az", "azure")


@dataclass(frozen=True)
class SharedKey:
    """An account name and key; signs requests with Azure's Shared Key scheme. The key is hidden from repr."""

    account: str
    key: str = field(repr=False)

    def sign(self, method: str, url: str, headers: Mapping[str, str], content_length: int = 0) -> str:
        """The ``Authorization`` value for ``method url`` with ``headers`` (the ``x-ms-*`` ones are signed)
        and a body of ``content_length`` bytes (uploads, in tests)."""
        parts = urlsplit(url)
        ms = sorted((k.lower(), v.strip()) for k, v in headers.items() if k.lower().startswith("x-ms-"))
        resource = f"/{self.account}{parts.path or '/'}"
        params: dict[str, list[str]] = {}
        for k, v in parse_qsl(parts.query, keep_blank_values=True):
            params.setdefault(k.lower(), []).append(v)
        resource += "".join(f"\n{k}:{','.join(sorted(v))}" for k, v in sorted(params.items()))
        # VERB, then 11 standard headers (only Content-Length is ever set, and "" stands for 0), then the
        # x-ms-* headers and the resource.
        length = str(content_length) if content_length else ""
        to_sign = f"{method.upper()}\n\n\n{length}" + "\n" * 9 + "".join(f"{k}:{v}\n" for k, v in ms) + resource
        mac = hmac.new(base64.b64decode(self.key), to_sign.encode(), hashlib.sha256).digest()
        return f"SharedKey {self.account}:{base64.b64encode(mac).decode()}"


Auth = SharedKey | Renewing[str] | str | None  # a Shared Key, an OAuth token, a SAS query string, anonymous


class AzureContainer(Store):
    """One Blob container: ``List Blobs`` and ``Get Blob``, authorised by Shared Key, SAS or OAuth token."""

    kind = "Azure Blob"

    def __init__(self, container: str, endpoint: str, auth: Auth, source: str = "") -> None:
        self._container = container
        self._endpoint = endpoint.rstrip("/")
        self._auth = auth
        self._source = source  # where the credentials came from, for messages
        self._sas = auth.lstrip("?") if isinstance(auth, str) else ""

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def bucket(self) -> str:
        return self._container

    @property
    def signed(self) -> bool:
        return self._auth is not None

    def _url(self, path: str, query: str = "") -> str:
        q = "&".join(p for p in (query, self._sas) if p)
        return f"{self._endpoint}/{quote(self._container, safe='')}{path}" + (f"?{q}" if q else "")

    def object_url(self, key: str) -> str:
        return self._url("/" + quote(key, safe="/~"))

    async def headers(self, method: str, url: str) -> Mapping[str, str] | None:
        out = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": API_VERSION}
        auth = self._auth
        if isinstance(auth, SharedKey):
            out["Authorization"] = auth.sign(method, url, out)
        elif isinstance(auth, Renewing):
            out["Authorization"] = f"Bearer {await auth.get()}"
        return out

    def list_url(self, prefix: str, token: str | None, page: int) -> str:
        q = f"restype=container&comp=list&prefix={quote(prefix, safe='')}&maxresults={page}"
        if token:
            q += f"&marker={quote(token, safe='')}"
        return self._url("", q)

    def parse_list(self, body: bytes) -> tuple[list[str], str | None]:
        root = ET.fromstring(body)
        keys = [name for blob in root.iter("Blob") if (name := blob.findtext("Name"))]
        return keys, (root.findtext("NextMarker") or "").strip() or None

    def parse_tags(self, body: bytes) -> dict[str, str]:
        out = {}
        for blob in ET.fromstring(body).iter("Blob"):
            name, props = blob.findtext("Name"), blob.find("Properties")
            etag = props.findtext("Etag") if props is not None else None
            if name and etag:
                out[name] = f"{etag}/{props.findtext('Content-Length') if props is not None else ''}"
        return out

    def credentials_refused(self, err: HTTPStatusError) -> bool:
        # Azure says AuthenticationFailed; Azurite says AuthorizationFailure with the same message.
        return err.status == 401 or err.code in _REFUSED or err.message.startswith("Server failed to authenticate")

    def bucket_missing(self, err: HTTPStatusError) -> bool:
        return err.status == 404 and err.code in ("ContainerNotFound", None)

    def credential_hint(self) -> str:
        return (
            f"credentials from {self._source or 'creds'}; check account_name / account_key / sas_token (or "
            "AZURE_STORAGE_ACCOUNT_NAME, AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN, "
            "AZURE_STORAGE_CONNECTION_STRING)"
        )

    def __repr__(self) -> str:
        return f"AzureContainer({self._container!r}, endpoint={self._endpoint!r}, {self._source or 'anonymous'})"


def parse_connection_string(text: str) -> dict[str, str]:
    """``Key=Value;...`` → a dict (``UseDevelopmentStorage=true`` expands to Azurite's well-known account)."""
    pairs = dict(p.split("=", 1) for p in text.split(";") if "=" in p)
    if pairs.get("UseDevelopmentStorage", "").lower() == "true":
        pairs = {
            "AccountName": "devstoreaccount1",
            "AccountKey": _AZURITE_KEY,
            "BlobEndpoint": "http://127.0.0.1:10000/devstoreaccount1",
        } | {k: v for k, v in pairs.items() if k != "UseDevelopmentStorage"}
    return pairs


#: Azurite's published development account key (not a secret: it is in Microsoft's documentation).
_AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def resolve_azure(
    url: str, creds: Mapping[str, str] | None = None, env: Mapping[str, str] | None = None
) -> AzureContainer:
    """The container of ``az://container/prefix`` with its endpoint and credentials (module docstring).
    Blocking (``DefaultAzureCredential`` may ask a token endpoint): call it off the event loop."""
    env = os.environ if env is None else env
    container, _ = split_az_url(url)
    c = {k: str(v) for k, v in (creds or {}).items() if v}
    conn_text = c.get("connection_string") or ("" if c else env.get("AZURE_STORAGE_CONNECTION_STRING", ""))
    conn = parse_connection_string(conn_text) if conn_text else {}
    source = "creds" if c else ("AZURE_STORAGE_CONNECTION_STRING" if conn else "environment")

    def pick(key: str, conn_key: str, *names: str) -> str | None:
        if c.get(key):
            return c[key]
        if conn.get(conn_key):
            return conn[conn_key]
        return next((env[n] for n in names if env.get(n) and not c), None)

    account = pick("account_name", "AccountName", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT")
    key = pick("account_key", "AccountKey", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_KEY")
    sas = pick("sas_token", "SharedAccessSignature", "AZURE_STORAGE_SAS_TOKEN")
    endpoint = c.get("endpoint_url") or conn.get("BlobEndpoint") or env.get("AZURE_STORAGE_ENDPOINT")
    if not endpoint:
        if not account:
            raise ValueError(
                f"no storage account for {url}: pass creds={{'account_name': ...}} or set AZURE_STORAGE_ACCOUNT_NAME"
            )
        endpoint = f"https://{account}.blob.core.windows.net"
    if key:
        if not account:
            raise ValueError(f"an account key for {url} needs the account name (account_name)")
        return AzureContainer(container, endpoint, SharedKey(account, key), f"{source}: account key")
    if sas:
        return AzureContainer(container, endpoint, sas, f"{source}: SAS token")
    if c.get("anonymous") or (c and not account):
        return AzureContainer(container, endpoint, None, "anonymous")
    return AzureContainer(container, endpoint, azure_token(), "DefaultAzureCredential")
