"""Google Cloud Storage (``gs://``) through ``ObjectStoreSource`` against a real local emulator
(``gcp-storage-emulator`` from PyPI, started by the session fixture): listing, manifests, exact rows,
typed and fast errors naming the URL. The emulator checks no credentials, so the credential tests here
are of the chain (google-auth): a service-account key traded for a token at a loopback token endpoint,
and broken keys failing clearly at open; Azure's tests cover a server refusing a key."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import pytest

from asyncload import AsyncLoader, DatasetNotFoundError, ObjectStoreSource, ReadError, SourceError
from asyncload.sources.stores.gcs import GCSBucket, resolve_gcs
from asyncload.sources.stores.store import BucketNotFoundError, StoreEndpointError
from harness.seaweed import _free_ports

from .remote_fixtures import EmulatedData, check_epoch, reply, serving

pytestmark = pytest.mark.timeout(60)
FAST_FAIL_S = 5.0


def test_listing_reads_every_row_once_with_original_pixels(gcs_data: EmulatedData) -> None:
    src = ObjectStoreSource(gcs_data.url, creds=gcs_data.creds, list_page_size=7)
    assert len(src) == gcs_data.rows  # 48 keys per column over 7 pages (pageToken followed)
    seen = check_epoch(iter(AsyncLoader(src, batch_size=8, shuffle=True, seed=1, concurrency=16)), gcs_data.images,
                       gcs_data.masks)  # fmt: skip
    assert collections.Counter(seen) == collections.Counter(range(gcs_data.rows))
    assert src.retry_stats()["retries"] == 0, src.retry_stats()  # (what was retried: its causes)


def test_emulator_host_variable_is_honoured_and_requests_are_anonymous(
    gcs_data: EmulatedData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``STORAGE_EMULATOR_HOST`` (what Google's clients read) points at the emulator, as for them."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_data.endpoint.removeprefix("http://"))
    store = resolve_gcs(gcs_data.url)
    assert isinstance(store, GCSBucket) and store.endpoint == gcs_data.endpoint and not store.signed
    assert len(ObjectStoreSource(gcs_data.url)) == gcs_data.rows


@pytest.mark.parametrize("manifest", ["object", "list"])
def test_manifest_rows_in_manifest_order(gcs_data: EmulatedData, manifest: str) -> None:
    order = [9, 2, 40]
    m = f"{gcs_data.url}/manifest.txt" if manifest == "object" else [f"{i:06d}" for i in order]
    src = ObjectStoreSource(gcs_data.url, creds=gcs_data.creds, manifest=m)
    assert len(src) == len(order)
    batch = next(iter(AsyncLoader(src, batch_size=3)))
    for j, i in enumerate(order):
        assert (batch["images"][j].numpy() == gcs_data.images[i]).all()
        assert (batch["masks"][j].numpy() == gcs_data.masks[i]).all()


def test_bearer_token_is_sent(gcs_data: EmulatedData) -> None:
    """A static token travels as ``Authorization: Bearer`` (the emulator accepts any) and is in no repr."""
    token = "ya29.not-a-real-token-" + "t" * 20
    src = ObjectStoreSource(gcs_data.url, creds=dict(gcs_data.creds, token=token))
    assert len(src) == gcs_data.rows
    assert token not in repr(src) and token not in repr(src.store())


def test_missing_object_raises_file_not_found_naming_the_key(gcs_data: EmulatedData) -> None:
    src = ObjectStoreSource(gcs_data.url, creds=gcs_data.creds, manifest=["000001", "000404x"])
    t0 = time.monotonic()
    with pytest.raises(ReadError) as info:
        list(AsyncLoader(src, batch_size=2))
    assert time.monotonic() - t0 < FAST_FAIL_S
    assert isinstance(info.value, FileNotFoundError)
    assert gcs_data.url in str(info.value) and "000404x.png" in str(info.value)
    assert info.value.indices == [1] and src.retry_stats()["retries"] == 0


def test_missing_bucket_and_down_endpoint_fail_fast_naming_them(gcs_data: EmulatedData) -> None:
    t0 = time.monotonic()
    with pytest.raises(BucketNotFoundError) as info:
        ObjectStoreSource("gs://no-such-bucket/files", creds=gcs_data.creds).open()
    assert isinstance(info.value, DatasetNotFoundError)
    assert "'no-such-bucket'" in str(info.value) and gcs_data.endpoint in str(info.value)
    (dead,) = _free_ports("127.0.0.1", 1)
    with pytest.raises(StoreEndpointError) as down:
        ObjectStoreSource(gcs_data.url, creds=dict(gcs_data.creds, endpoint_url=f"http://127.0.0.1:{dead}")).open()
    assert f"127.0.0.1:{dead}" in str(down.value) and "'asyncload-gcs'" in str(down.value)
    assert time.monotonic() - t0 < 2 * FAST_FAIL_S


def test_broken_application_credentials_fail_at_open_naming_the_file(
    gcs_data: EmulatedData, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chain (google-auth) reads GOOGLE_APPLICATION_CREDENTIALS; a key that is no key fails clearly,
    fast, and the private key's text is not in the message."""
    secret = "-----BEGIN PRIVATE KEY-----\nTOTALLY-NOT-A-KEY\n-----END PRIVATE KEY-----\n"
    key = tmp_path / "sa.json"
    key.write_text(json.dumps({"type": "service_account", "client_email": "x@p.iam.gserviceaccount.com",
                               "private_key": secret, "private_key_id": "1", "token_uri": "http://127.0.0.1:9/t"}))  # fmt: skip
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    t0 = time.monotonic()
    with pytest.raises(SourceError) as info:
        ObjectStoreSource("gs://asyncload-gcs/files").open()
    assert time.monotonic() - t0 < FAST_FAIL_S
    assert "TOTALLY-NOT-A-KEY" not in str(info.value) and "Google" in str(info.value)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(SourceError, match="missing.json"):
        ObjectStoreSource("gs://asyncload-gcs/files").open()


class _TokenEndpoint(BaseHTTPRequestHandler):
    """Google's OAuth token endpoint as google-auth calls it for a service account (a JWT grant)."""

    grants: list[dict[str, list[str]]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        self.grants.append(parse_qs(self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode()))
        body = json.dumps({"access_token": f"ya29.loopback-{len(self.grants)}", "expires_in": 3600}).encode()
        reply(self, body, headers={"Content-Type": "application/json"})


def test_application_default_credentials_from_a_service_account_file(
    gcs_data: EmulatedData, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GOOGLE_APPLICATION_CREDENTIALS names a service-account key (a real RSA key made here): google-auth
    signs a JWT grant and trades it at the key's token_uri (a loopback endpoint) for the bearer token that
    every read then carries; the private key is in no repr."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = (
        rsa.generate_private_key(public_exponent=65537, key_size=2048)
        .private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        .decode()
    )
    handler = type("Token", (_TokenEndpoint,), {"grants": []})
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as token_endpoint:
        key = tmp_path / "sa.json"
        key.write_text(json.dumps({
            "type": "service_account", "project_id": "p", "private_key_id": "k1", "private_key": pem,
            "client_email": "reader@p.iam.gserviceaccount.com", "client_id": "1",
            "token_uri": f"{token_endpoint}/token",
        }))  # fmt: skip
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
        src = ObjectStoreSource(gcs_data.url, creds={"endpoint_url": gcs_data.endpoint})
        seen = check_epoch(iter(AsyncLoader(src, batch_size=16)), gcs_data.images, gcs_data.masks)
        assert sorted(seen) == list(range(gcs_data.rows))
        store = src.store()
        assert asyncio.run(store.headers("GET", store.object_url("x"))) == {"Authorization": "Bearer ya29.loopback-1"}
        (grant,) = handler.grants  # one token for the whole run
        assert grant["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]
        assert "PRIVATE KEY" not in repr(store) + repr(src)
