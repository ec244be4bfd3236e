"""Remote stores on a real S3 server (SeaweedFS on loopback, signatures checked): Deep Lake on ``s3://``
and the object-store source, through ``AsyncLoader``; clear, fast, secret-free errors; retries across a
server restart; a clear error when the server is gone for good."""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import json
import logging
import pickle
import threading
import time
import traceback
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from asyncload import AsyncLoader, DatasetNotFoundError, DeepLakeSource, ObjectStoreSource, ReadError, SourceError
from asyncload.sources.stores.http import HTTPStatusError
from asyncload.sources.stores.probe import S3AccessError, S3BucketNotFoundError, S3EndpointError
from asyncload.sources.stores.retry import RetryPolicy, is_transient
from asyncload.sources.stores.sigv4 import Credentials, SigV4Signer
from harness.seaweed import SeaweedServer, WeedNotFoundError, _free_ports

from .conftest import wait_no_loop_threads
from .remote_fixtures import RemoteData, originals, read_epoch, upload_files

# pytest finds fixtures among a module's names; naming them here also tells linters the import is used.
pytestmark = pytest.mark.timeout(60)

FAST_FAIL_S = 5.0  # "fails fast": what an open or a permanent read error may take


def full_text(exc: BaseException) -> str:
    """Everything a user could see of ``exc``: its chain, formatted."""
    return "".join(traceback.format_exception(exc))


def epoch(loader: AsyncLoader, data: RemoteData) -> list[int]:
    """Run one epoch; check every sample's pixels against the originals; return the indices seen."""
    return read_epoch(iter(loader), data)


def sources(data: RemoteData, creds: dict[str, str]) -> dict[str, object]:
    return {
        "deeplake": lambda: DeepLakeSource(data.deeplake_url, creds=creds),
        "objectstore": lambda: ObjectStoreSource(data.files_url, creds=creds),
    }


# -- signing ---------------------------------------------------------------------------------------


def test_sigv4_matches_the_published_aws_example() -> None:
    """AWS's documented GetObject example (bucket examplebucket, 2013-05-24, Range bytes=0-9)."""
    signer = SigV4Signer(Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"), "us-east-1")
    headers = signer.sign(
        "GET", "https://examplebucket.s3.amazonaws.com/test.txt", {"Range": "bytes=0-9"},
        now=dt.datetime(2013, 5, 24, tzinfo=dt.UTC),
    )  # fmt: skip
    assert headers["Authorization"].endswith(
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )
    assert "wJalr" not in repr(signer) and "wJalr" not in repr(signer.credentials)


# -- exactly-once epochs ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["deeplake", "objectstore"])
def test_epoch_on_s3_is_exactly_once_with_original_pixels(remote_data: RemoteData, kind: str, caplog) -> None:
    src = sources(remote_data, remote_data.creds())[kind]()
    caplog.set_level(logging.ERROR, logger="asyncio")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = AsyncLoader(src, batch_size=16, shuffle=True, seed=3, concurrency=64)
        seen = epoch(loader, remote_data)
        del loader
        gc.collect()
    assert sorted(seen) == list(range(remote_data.rows)) and seen != sorted(seen)
    unclosed = [str(w.message) for w in caught if "nclosed" in str(w.message)] + [
        r.getMessage() for r in caplog.records if "nclosed" in r.getMessage()
    ]
    assert not unclosed, unclosed
    wait_no_loop_threads()  # the loop thread and the decode pool end with the epoch


def test_objectstore_row_mode_and_unordered_delivery(remote_data: RemoteData) -> None:
    src = ObjectStoreSource(remote_data.files_url, creds=remote_data.creds())
    loader = AsyncLoader(src, batch_size=10, read_mode="row", in_order=False, concurrency=32)
    assert sorted(epoch(loader, remote_data)) == list(range(remote_data.rows))
    assert src.retry_stats()["retries"] == 0
    assert src.connections() >= 32 * len(src.columns)  # the pool covers the fan-out (aiohttp's default is 100)


def test_objectstore_listing_follows_continuation_tokens(remote_data: RemoteData) -> None:
    src = ObjectStoreSource(remote_data.files_url, creds=remote_data.creds(), list_page_size=7)
    assert len(src) == remote_data.rows  # 96 keys per column over 14 pages
    assert src.retry_stats()["requests"] == 2 * 14


def test_objectstore_manifest_over_plain_http(remote_data: RemoteData, tmp_path) -> None:
    """An http:// prefix (the filer serves objects unsigned) needs a manifest; rows follow its order."""
    order = [5, 0, 17, 3]
    manifest = tmp_path / "stems.txt"
    manifest.write_text("# a comment\n" + "\n".join(f"{i:06d}" for i in order) + "\n")
    url = f"{remote_data.server.filer_url}/buckets/{remote_data.bucket}/files"
    src = ObjectStoreSource(url, manifest=str(manifest))
    assert len(src) == len(order)
    batch = next(iter(AsyncLoader(src, batch_size=4)))
    for j, i in enumerate(order):
        assert np.array_equal(batch["images"][j].numpy(), remote_data.images[i])
        assert np.array_equal(batch["masks"][j].numpy(), remote_data.masks[i])
    with pytest.raises(Exception, match="manifest"):
        ObjectStoreSource(url)  # HTTP cannot be listed


def test_objectstore_manifest_object_on_s3_gives_rows_in_its_order(remote_data: RemoteData) -> None:
    order = [31, 4, 77, 4]  # a repeated stem is a repeated row
    key = "manifests/order.json"
    remote_data.server.put_object(remote_data.bucket, key, json.dumps({"stems": [f"{i:06d}" for i in order]}).encode())
    src = ObjectStoreSource(
        remote_data.files_url, creds=remote_data.creds(), manifest=f"s3://{remote_data.bucket}/{key}"
    )
    assert len(src) == len(order)
    batch = next(iter(AsyncLoader(src, batch_size=4)))
    assert batch["index"].tolist() == [0, 1, 2, 3]
    for j, i in enumerate(order):
        assert np.array_equal(batch["images"][j].numpy(), remote_data.images[i])
        assert np.array_equal(batch["masks"][j].numpy(), remote_data.masks[i])
    with pytest.raises(DatasetNotFoundError, match="manifests/missing.json"):
        ObjectStoreSource(
            remote_data.files_url,
            creds=remote_data.creds(),
            manifest=f"s3://{remote_data.bucket}/manifests/missing.json",
        ).open()


# -- clear, fast errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["deeplake", "objectstore"])
def test_wrong_secret_fails_fast_naming_endpoint_and_bucket_without_the_secret(
    remote_data: RemoteData, kind: str
) -> None:
    wrong = "WRONG-secret-" + "z" * 24
    creds = dict(remote_data.creds(), aws_secret_access_key=wrong)
    t0 = time.monotonic()
    with pytest.raises(S3AccessError) as info:
        sources(remote_data, creds)[kind]().open()
    assert time.monotonic() - t0 < FAST_FAIL_S
    text = full_text(info.value)
    assert remote_data.server.endpoint_url in str(info.value) and repr(remote_data.bucket) in str(info.value)
    assert "SignatureDoesNotMatch" in str(info.value)
    assert wrong not in text and remote_data.server.secret_key not in text
    assert isinstance(info.value, PermissionError)


@pytest.mark.parametrize("kind", ["deeplake", "objectstore"])
def test_missing_bucket_fails_fast(remote_data: RemoteData, kind: str) -> None:
    creds = remote_data.creds()
    make = {
        "deeplake": lambda: DeepLakeSource("s3://no-such-bucket/seg", creds=creds),
        "objectstore": lambda: ObjectStoreSource("s3://no-such-bucket/files", creds=creds),
    }[kind]
    t0 = time.monotonic()
    with pytest.raises(S3BucketNotFoundError) as info:
        make().open()
    assert time.monotonic() - t0 < FAST_FAIL_S
    assert isinstance(info.value, DatasetNotFoundError)
    assert "'no-such-bucket'" in str(info.value) and remote_data.server.endpoint_url in str(info.value)
    assert remote_data.server.secret_key not in full_text(info.value)


def test_missing_deeplake_dataset_in_an_existing_bucket(remote_data: RemoteData) -> None:
    t0 = time.monotonic()
    with pytest.raises(DatasetNotFoundError, match="s3://asyncload-test/not-here"):
        DeepLakeSource(f"s3://{remote_data.bucket}/not-here", creds=remote_data.creds()).open()
    assert time.monotonic() - t0 < FAST_FAIL_S


def test_objectstore_missing_key_fails_at_once_naming_the_key(remote_data: RemoteData) -> None:
    src = ObjectStoreSource(remote_data.files_url, creds=remote_data.creds(), manifest=["000001", "000404x"])
    t0 = time.monotonic()
    with pytest.raises(ReadError) as info:
        for _ in AsyncLoader(src, batch_size=2):
            pass
    assert time.monotonic() - t0 < FAST_FAIL_S
    err = info.value
    assert isinstance(err, FileNotFoundError)  # typed after the cause: `except FileNotFoundError` works
    assert remote_data.files_url in str(err) and "000404x.png" in str(err)
    assert "1 attempt " in str(err) and "NoSuchKey" in str(err)
    assert err.indices == [1]
    assert src.retry_stats()["retries"] == 0  # a 404 is not retried
    assert remote_data.server.secret_key not in full_text(err)


def test_objectstore_with_no_files_under_the_prefix(remote_data: RemoteData) -> None:
    with pytest.raises(DatasetNotFoundError, match="no samples"):
        ObjectStoreSource(f"s3://{remote_data.bucket}/empty-prefix", creds=remote_data.creds()).open()


@pytest.mark.parametrize("kind", ["deeplake", "objectstore"])
def test_endpoint_down_fails_fast(remote_data: RemoteData, kind: str) -> None:
    (dead,) = _free_ports("127.0.0.1", 1)
    creds = dict(remote_data.creds(), endpoint_url=f"http://127.0.0.1:{dead}")
    t0 = time.monotonic()
    with pytest.raises(S3EndpointError) as info:
        sources(remote_data, creds)[kind]().open()
    assert time.monotonic() - t0 < FAST_FAIL_S
    assert isinstance(info.value, (SourceError, ConnectionError))
    assert f"127.0.0.1:{dead}" in str(info.value) and repr(remote_data.bucket) in str(info.value)
    assert remote_data.server.secret_key not in full_text(info.value)


# -- outages ----------------------------------------------------------------------------------------


def test_objectstore_epoch_survives_a_server_restart_mid_epoch(
    remote_data: RemoteData, running_seaweed: SeaweedServer
) -> None:
    server = running_seaweed
    port = server.port
    patient = RetryPolicy(max_attempts=60, base_delay=0.05, max_delay=0.5, max_elapsed=40.0, budget=10_000)
    src = ObjectStoreSource(remote_data.files_url, creds=remote_data.creds(), retry=patient)
    # Small slots so most of the epoch is still to be read when the server goes away.
    loader = AsyncLoader(src, batch_size=8, concurrency=16, prefetch=1)
    seen: list[int] = []
    restarter: threading.Thread | None = None
    it = iter(loader)
    for n, b in enumerate(it):
        seen += b["index"].tolist()
        for j, i in enumerate(b["index"].tolist()):
            assert np.array_equal(b["images"][j].numpy(), remote_data.images[i])
        if n == 1:
            server.stop()  # reads issued from now on meet a closed port until the restart
            restarter = threading.Thread(target=lambda: (time.sleep(0.7), server.start()))
            restarter.start()
    assert restarter is not None
    restarter.join(30)
    assert server.running and server.port == port
    assert sorted(seen) == list(range(remote_data.rows))
    stats = src.retry_stats()
    assert stats["retries"] > 0 and stats["gave_up"] == 0, stats


@pytest.fixture
def doomed_server(tmp_path) -> Iterator[SeaweedServer]:
    """A private server with a few files, for a test that kills it (the session server stays intact)."""
    try:
        server = SeaweedServer(tmp_path / "doomed")
    except WeedNotFoundError as exc:
        pytest.skip(str(exc))
    with server:
        server.create_bucket("doomed")
        images, masks = originals(32)
        upload_files(server, "doomed", "files", images, masks)
        yield server


@pytest.mark.parametrize("limit", ["attempts", "budget"])
def test_server_killed_for_good_gives_a_clear_error_within_a_deadline(doomed_server: SeaweedServer, limit: str) -> None:
    # trip_after=0: no breaker, so that each limit is what ends it (with the breaker, a store that is gone
    # is waited for as one outage until stall_timeout: tests/test_stall.py, test_faults)
    policy = {
        "attempts": RetryPolicy(max_attempts=4, base_delay=0.05, max_delay=0.2, trip_after=0),
        "budget": RetryPolicy(
            max_attempts=1000, base_delay=0.05, max_delay=0.2, budget=20, refill_per_success=0, trip_after=0
        ),
    }[limit]
    src = ObjectStoreSource("s3://doomed/files", creds=doomed_server.creds(), retry=policy)
    loader = AsyncLoader(src, batch_size=4, concurrency=8, prefetch=1)
    it = iter(loader)
    next(it)
    doomed_server.stop(kill=True)
    t0 = time.monotonic()
    with pytest.raises(ReadError) as info:
        for _ in it:
            pass
    assert time.monotonic() - t0 < 10.0
    err = info.value
    assert isinstance(err, ConnectionError)
    text = str(err)
    assert "s3://doomed/files/" in text and ".png" in text  # the source and the key
    assert "attempt" in text  # how many
    assert any(s in text for s in ("Cannot connect", "Disconnected", "reset by peer")), text  # the last cause
    if limit == "budget":
        assert "retry budget" in text and src.retry_stats()["budget_exhausted"] > 0
    else:
        assert "after 4 attempts" in text
    assert doomed_server.secret_key not in full_text(err)
    wait_no_loop_threads()


# -- credentials from the environment, pickling, reading outside the loader ------------------------------


def test_both_sources_take_credentials_from_aws_environment_variables(remote_data: RemoteData, monkeypatch) -> None:
    for k, v in remote_data.server.env().items():
        monkeypatch.setenv(k, v)
    assert len(DeepLakeSource(remote_data.deeplake_url).open()) == remote_data.rows
    assert len(ObjectStoreSource(remote_data.files_url).open()) == remote_data.rows
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-at-all")
    with pytest.raises(S3AccessError):
        ObjectStoreSource(remote_data.files_url).open()


def test_objectstore_pickles_without_its_session_and_reads_on_any_loop(remote_data: RemoteData) -> None:
    """A copy (as a spawned DataLoader worker gets it) reopens by itself; ``asyncio.run`` closes its session."""
    src = ObjectStoreSource(remote_data.files_url, creds=remote_data.creds()).open()
    copy = pickle.loads(pickle.dumps(src))
    assert copy._handle_obj is None and remote_data.server.secret_key not in repr(copy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        cols = asyncio.run(copy.read([7, 2]))
        gc.collect()
    assert np.array_equal(cols["images"][0], remote_data.images[7])
    assert np.array_equal(cols["masks"][1], remote_data.masks[2])
    assert cols["masks"][1].shape == (40, 56) and cols["images"][0].shape == (40, 56, 3)
    assert len(copy._loops) == 0  # the session of that loop was closed with it


# -- the retry policy's rules ----------------------------------------------------------------------------


def test_retry_policy_classifies_failures_and_honours_retry_after() -> None:
    assert not is_transient(HTTPStatusError(404, code="NoSuchKey"))
    assert not is_transient(HTTPStatusError(403, code="SignatureDoesNotMatch"))
    assert is_transient(HTTPStatusError(503, code="SlowDown"))
    assert is_transient(HTTPStatusError(400, code="RequestTimeout"))
    assert is_transient(HTTPStatusError(429)) and is_transient(ConnectionResetError()) and is_transient(TimeoutError())
    assert not is_transient(FileNotFoundError("a local file"))
    policy = RetryPolicy(base_delay=0.1, max_delay=1.0, max_retry_after=5.0)
    assert policy.backoff(1, HTTPStatusError(429, retry_after=2.0)) == 2.0
    assert policy.backoff(1, HTTPStatusError(503, retry_after=60.0)) == 5.0
    delays = [policy.backoff(n) for n in (1, 3, 10) for _ in range(200)]
    assert all(0 <= d <= 1.0 for d in delays) and max(delays[400:]) > 0.5  # full jitter up to the cap
