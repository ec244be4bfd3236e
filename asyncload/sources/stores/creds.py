"""Credentials from each cloud's standard chain, fetched off the event loop and renewed before they expire.

Why maintained libraries rather than our own: the chains are long and keep growing (AWS: environment,
shared credentials and config files with profiles, ``credential_process``, SSO, web identity, container
and instance metadata; Google: ``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's ADC file, workload identity
federation, the metadata server; Azure: service principals, workload and managed identity, the Azure CLI),
each with its own files, caches and refresh rules. botocore, google-auth and azure-identity implement them
as their SDKs do, so a machine where ``aws s3 ls`` / ``gsutil`` / ``az storage`` work reads here too.

Why off the loop: resolving a chain reads files and may ask a metadata server or a token endpoint (with
timeouts of a second or more), and importing botocore is slow (``benchmarks/results/design_notes.md``); on
the loader's loop either would stall every read in flight. So the first fetch runs where the source opens
(a helper thread) and a renewal runs in a worker thread via ``asyncio.to_thread`` while other requests go
on with the still-valid credential.

Each library is imported only when its cloud is used. Nothing here logs or formats a secret: the values
live in :class:`~asyncload.sources.stores.sigv4.Credentials` (secret hidden from its repr) or in a token string that is
only ever put in an ``Authorization`` header.
"""

from __future__ import annotations

import asyncio
import datetime as _dt
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar

from ...errors import ConfigError, SourceError
from .sigv4 import Credentials

T = TypeVar("T")

#: Renew a credential this long before it expires (botocore's mandatory refresh window is 10 minutes,
#: google-auth's threshold under 4, azure-identity's 5; renewing inside all of them means the library
#: really fetches a new one when asked).
RENEW_MARGIN_S = 600.0


class Renewing(Generic[T]):
    """A credential fetched by a blocking ``fetch() -> (value, expires_at epoch seconds or None)``, renewed
    in a worker thread when less than ``margin_s`` of its life is left. Thread-safe; one renewal at a time."""

    def __init__(self, fetch: Callable[[], tuple[T, float | None]], what: str, margin_s: float = RENEW_MARGIN_S):
        self._fetch = fetch
        self.what = what  # where it comes from, for messages ("shared-credentials-file, profile 'x'")
        self.margin_s = margin_s
        self._lock = threading.Lock()
        self._value: tuple[T, float | None] | None = None

    def _fresh(self) -> T | None:
        v = self._value
        if v is None or (v[1] is not None and v[1] - time.time() <= self.margin_s):
            return None
        return v[0]

    def get_blocking(self) -> T:
        """The credential, fetching it here if it is missing or about to expire."""
        with self._lock:
            value = self._fresh()
            if value is None:
                self._value = self._fetch()
                value = self._value[0]
            return value

    async def get(self) -> T:
        """The credential; a fetch (first or renewal) runs in a worker thread, never on the loop."""
        value = self._fresh()
        return value if value is not None else await asyncio.to_thread(self.get_blocking)

    def __repr__(self) -> str:
        return f"Renewing({self.what!r})"


def _epoch(when: _dt.datetime | None) -> float | None:
    if when is None:
        return None
    if when.tzinfo is None:  # google-auth keeps naive UTC datetimes
        when = when.replace(tzinfo=_dt.UTC)
    return when.timestamp()


# -- AWS --------------------------------------------------------------------------------------------------------


def aws_profile(creds: Mapping[str, str] | None, profile: str | None) -> str | None:
    """The profile asked for: ``profile=``, Deep Lake's ``creds["profile_name"]``, else ``AWS_PROFILE``
    (botocore reads that one itself)."""
    return profile or (creds or {}).get("profile_name") or None


def aws_chain(profile: str | None) -> tuple[Renewing[Credentials] | None, str | None, str | None]:
    """Credentials, region and endpoint from botocore's standard chain for ``profile``.

    Blocking (files, SSO cache, metadata service): call it off the event loop. Returns ``(None, ...)``
    when the chain finds no credentials (anonymous requests then).
    """
    try:
        import botocore.session
        from botocore.exceptions import BotoCoreError
    except ImportError as exc:  # pragma: no cover - the s3 extra
        raise ConfigError(
            "reading s3:// without explicit keys needs botocore for the standard credential chain: "
            "pip install 'torch-asyncload[s3]'"
        ) from exc
    try:
        session = botocore.session.Session(profile=profile)
        scoped = session.get_scoped_config()  # raises ProfileNotFound for an unknown profile
        region = session.get_config_variable("region")
        s3_section = scoped.get("s3") if isinstance(scoped.get("s3"), dict) else {}
        endpoint = s3_section.get("endpoint_url") or scoped.get("endpoint_url")
        found = session.get_credentials()
    except BotoCoreError as exc:
        files = (
            os.environ.get("AWS_CONFIG_FILE", "~/.aws/config"),
            os.environ.get("AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials"),
        )
        who = f"profile {profile!r}" if profile else "the default profile"
        raise SourceError(
            f"cannot get AWS credentials for {who} (config files {files[0]}, {files[1]}): {exc}"
        ) from None
    if found is None:
        return None, region, endpoint
    method = getattr(found, "method", "unknown")
    what = f"{method}" + (f", profile {profile!r}" if profile else "")

    def fetch() -> tuple[Credentials, float | None]:
        try:
            frozen = found.get_frozen_credentials()  # refreshes a refreshable set when it is due
        except BotoCoreError as exc:
            raise SourceError(f"cannot get AWS credentials from {what}: {exc}") from None
        expiry = getattr(found, "_expiry_time", None)  # botocore's own record of the current set's expiry
        return Credentials(frozen.access_key, frozen.secret_key, frozen.token or None), _epoch(expiry)

    renewing: Renewing[Credentials] = Renewing(fetch, what)
    renewing.get_blocking()  # fail here, at open, if the chain's source cannot deliver
    return renewing, region, endpoint


# -- Google Cloud Storage ---------------------------------------------------------------------------------------

GCS_READ_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"


def gcs_token(info: Mapping[str, Any] | None) -> Renewing[str]:
    """A bearer token from a service-account ``info`` mapping, else google-auth's application default
    credentials chain (``GOOGLE_APPLICATION_CREDENTIALS``, gcloud's ADC file, workload identity
    federation, the metadata server). Blocking: call it off the event loop."""
    try:
        import google.auth
        import google.auth.transport.requests
        from google.auth.exceptions import GoogleAuthError
    except ImportError as exc:  # pragma: no cover - the gcs extra
        raise ConfigError("reading gs:// needs google-auth: pip install 'torch-asyncload[gcs]'") from exc
    try:
        if info:
            from google.oauth2 import service_account

            gcreds: Any = service_account.Credentials.from_service_account_info(dict(info), scopes=[GCS_READ_SCOPE])
            what = f"service account {info.get('client_email', '?')}"
        else:
            gcreds, project = google.auth.default(scopes=[GCS_READ_SCOPE])
            what = f"application default credentials ({type(gcreds).__module__}.{type(gcreds).__name__})"
    except (GoogleAuthError, ValueError) as exc:
        raise SourceError(f"cannot get Google Cloud credentials: {exc}") from None
    request = google.auth.transport.requests.Request()

    def fetch() -> tuple[str, float | None]:
        try:
            gcreds.refresh(request)
        except GoogleAuthError as exc:
            raise SourceError(f"cannot get a Google Cloud access token from {what}: {exc}") from None
        return str(gcreds.token), _epoch(gcreds.expiry)

    return Renewing(fetch, what)


# -- Azure ------------------------------------------------------------------------------------------------------

AZURE_STORAGE_SCOPE = "https://storage.azure.com/.default"


def azure_token() -> Renewing[str]:
    """A bearer token from azure-identity's ``DefaultAzureCredential`` chain (environment service
    principal, workload identity, managed identity, Azure CLI, ...). Blocking: call it off the loop."""
    try:
        from azure.core.exceptions import AzureError
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:  # pragma: no cover - the azure extra
        raise ConfigError(
            "reading az:// without an account key or SAS token needs azure-identity: pip install 'torch-asyncload[azure]'"
        ) from exc
    credential = DefaultAzureCredential(exclude_interactive_browser_credential=True)

    def fetch() -> tuple[str, float | None]:
        try:
            token = credential.get_token(AZURE_STORAGE_SCOPE)
        except AzureError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise SourceError(f"cannot get an Azure access token from DefaultAzureCredential: {first}") from None
        return token.token, float(token.expires_on)

    renewing: Renewing[str] = Renewing(fetch, "DefaultAzureCredential")
    renewing.get_blocking()
    return renewing
