"""Azure Blob (``az://``) through ``ObjectStoreSource`` against a real local Azurite (from npm, started by
the session fixture; it checks Shared Key signatures as Azure does): listing, manifests, exact rows, the
environment and connection strings Azure's tools read, typed and fast errors, no secret anywhere."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import pickle
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from asyncload import AsyncLoader, DatasetNotFoundError, ObjectStoreSource, ReadError
from asyncload.sources.stores.azure import AzureContainer, resolve_azure
from asyncload.sources.stores.store import BucketNotFoundError, StoreAccessError

from .remote_fixtures import AZURITE_ACCOUNT, EmulatedData, check_epoch, reply, serving

pytestmark = pytest.mark.timeout(60)
FAST_FAIL_S = 5.0
WRONG_KEY = "V1JPTkcta2V5LW5vdC10aGUtb25l" + "A" * 60  # base64, the right length class, not the key


def full_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc)


@pytest.mark.parametrize("scheme", ["az", "azure"])
def test_listing_reads_every_row_once_with_original_pixels(azure_data: EmulatedData, scheme: str) -> None:
    url = azure_data.url.replace("az://", f"{scheme}://")
    src = ObjectStoreSource(url, creds=azure_data.creds, list_page_size=7)
    assert len(src) == azure_data.rows  # 7 pages per column (marker followed)
    seen = check_epoch(iter(AsyncLoader(src, batch_size=8, shuffle=True, seed=2, concurrency=16)), azure_data.images,
                       azure_data.masks)  # fmt: skip
    assert collections.Counter(seen) == collections.Counter(range(azure_data.rows))
    assert src.retry_stats()["retries"] == 0


@pytest.mark.parametrize("manifest", ["object", "list"])
def test_manifest_rows_in_manifest_order(azure_data: EmulatedData, manifest: str) -> None:
    order = [9, 2, 40]
    m = f"{azure_data.url}/manifest.txt" if manifest == "object" else [f"{i:06d}" for i in order]
    src = ObjectStoreSource(azure_data.url, creds=azure_data.creds, manifest=m)
    batch = next(iter(AsyncLoader(src, batch_size=3)))
    assert batch["index"].tolist() == [0, 1, 2]
    for j, i in enumerate(order):
        assert (batch["images"][j].numpy() == azure_data.images[i]).all()
        assert (batch["masks"][j].numpy() == azure_data.masks[i]).all()


def test_credentials_from_the_environment_and_a_connection_string(
    azure_data: EmulatedData, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = azure_data.creds["account_key"]
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", AZURITE_ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", key)
    monkeypatch.setenv("AZURE_STORAGE_ENDPOINT", azure_data.endpoint)
    src = ObjectStoreSource(azure_data.url)
    assert len(src) == azure_data.rows and "environment: account key" in repr(src.store())
    for name in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_ENDPOINT"):
        monkeypatch.delenv(name)
    conn = f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={key};BlobEndpoint={azure_data.endpoint};"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", conn)
    store = resolve_azure(azure_data.url)
    assert isinstance(store, AzureContainer) and store.endpoint == azure_data.endpoint
    assert len(ObjectStoreSource(azure_data.url)) == azure_data.rows
    assert key not in repr(store)


def test_wrong_key_fails_fast_naming_endpoint_and_container_never_the_key(azure_data: EmulatedData) -> None:
    creds = dict(azure_data.creds, account_key=WRONG_KEY)
    t0 = time.monotonic()
    with pytest.raises(StoreAccessError) as info:
        ObjectStoreSource(azure_data.url, creds=creds).open()
    assert time.monotonic() - t0 < FAST_FAIL_S
    err = info.value
    assert isinstance(err, PermissionError) and "rejected the credentials" in str(err)
    assert "Server failed to authenticate" in str(err) and "account_key" in str(err)  # the server's word, a hint
    assert azure_data.endpoint in str(err) and "'asyncload-az'" in str(err)
    text = full_text(err)
    assert WRONG_KEY not in text and azure_data.creds["account_key"] not in text
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is StoreAccessError and str(back) == str(err)


def test_missing_container_fails_fast(azure_data: EmulatedData) -> None:
    t0 = time.monotonic()
    with pytest.raises(BucketNotFoundError) as info:
        ObjectStoreSource("az://no-such-container/files", creds=azure_data.creds).open()
    assert time.monotonic() - t0 < FAST_FAIL_S
    assert isinstance(info.value, DatasetNotFoundError) and "'no-such-container'" in str(info.value)
    assert "ContainerNotFound" in str(info.value)


def test_missing_blob_raises_file_not_found_naming_the_key(azure_data: EmulatedData) -> None:
    src = ObjectStoreSource(azure_data.url, creds=azure_data.creds, manifest=["000001", "000404x"])
    with pytest.raises(ReadError) as info:
        list(AsyncLoader(src, batch_size=2))
    err = info.value
    assert isinstance(err, FileNotFoundError) and "BlobNotFound" in str(err)
    assert azure_data.url in str(err) and "000404x.png" in str(err) and err.indices == [1]
    assert azure_data.creds["account_key"] not in full_text(err)


def test_pickled_source_reopens_with_its_credentials(azure_data: EmulatedData) -> None:
    """As a spawned DataLoader worker gets it: the store (a live object) is not pickled; the copy resolves
    its own from the creds it carries."""
    src = ObjectStoreSource(azure_data.url, creds=azure_data.creds).open()
    copy = pickle.loads(pickle.dumps(src))
    assert copy._store is None and len(copy) == azure_data.rows
    assert azure_data.creds["account_key"] not in repr(copy)


def test_without_key_or_sas_the_identity_chain_is_asked_and_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    """No key, SAS or connection string: azure-identity's DefaultAzureCredential is the chain; on a machine
    with none of its sources (as here: no service principal, managed identity, CLI) the open fails fast
    with a SourceError that names it. A missing account name is a ConfigError naming the setting."""
    pytest.importorskip("azure.identity", reason="azure-identity (the azure extra) is not installed")
    from asyncload import ConfigError, SourceError

    for k in list(os.environ):
        if k.startswith(("AZURE_", "IDENTITY_", "MSI_")):
            monkeypatch.delenv(k)
    with pytest.raises(ConfigError, match="account_name"):
        ObjectStoreSource("az://c/p").open()
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "asyncloadnoaccount")
    t0 = time.monotonic()
    with pytest.raises(SourceError, match="DefaultAzureCredential"):
        ObjectStoreSource("az://c/p").open()
    assert time.monotonic() - t0 < 15.0


class _ManagedIdentity(BaseHTTPRequestHandler):
    """App Service's managed-identity endpoint as azure-identity calls it (``IDENTITY_ENDPOINT``)."""

    asked: list[tuple[str, str | None]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.asked.append((self.path, self.headers.get("X-IDENTITY-HEADER")))
        body = json.dumps({"access_token": f"eyJ.managed-{len(self.asked)}", "expires_on": str(int(time.time()) + 3600),
                           "resource": "https://storage.azure.com", "token_type": "Bearer"}).encode()  # fmt: skip
        reply(self, body, headers={"Content-Type": "application/json"})


def test_managed_identity_token_from_the_identity_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    """No key: DefaultAzureCredential finds a managed identity (a loopback App Service identity endpoint)
    and every request carries its OAuth token. Azurite takes OAuth only over HTTPS with --oauth, so this
    checks the headers the store would send rather than a read."""
    pytest.importorskip("azure.identity", reason="azure-identity (the azure extra) is not installed")
    for k in list(os.environ):
        if k.startswith(("AZURE_", "IDENTITY_", "MSI_")):
            monkeypatch.delenv(k)
    handler = type("Mi", (_ManagedIdentity,), {"asked": []})
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as endpoint:
        monkeypatch.setenv("IDENTITY_ENDPOINT", f"{endpoint}/msi/token")
        monkeypatch.setenv("IDENTITY_HEADER", "identity-header-value")
        monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "asyncloadacct")
        store = resolve_azure("az://data/train")
        assert store.endpoint == "https://asyncloadacct.blob.core.windows.net" and "DefaultAzureCredential" in repr(
            store
        )
        headers = asyncio.run(store.headers("GET", store.object_url("images/000001.png")))
    assert headers is not None and headers["Authorization"] == "Bearer eyJ.managed-1"
    path, header = handler.asked[0]
    assert path.startswith("/msi/token") and "resource=https" in path and header == "identity-header-value"
