"""Fixtures for tests against a real S3 server (SeaweedFS ``weed mini`` on loopback).

``tests/conftest.py`` registers the fixtures for every module; a server starts only when a test asks for
it. Never import a fixture into a test module: pytest makes it that module's own, and a session fixture
then starts once per module (a server for each, kept to the session's end).

``seaweed`` is started once per test process and always stopped (the context manager runs on any outcome,
and a finaliser in the server object kills it if the interpreter gets there first). ``remote_data``
writes the synthetic dataset twice into one bucket: as a Deep Lake dataset at ``s3://<bucket>/seg`` and
as plain PNG files ``s3://<bucket>/files/{images,masks}/<stem>.png`` for the object-store source, and
keeps the original arrays to compare pixels against.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import quote, urlsplit

import numpy as np
import pytest

from asyncload import make_dataset
from asyncload.tools.synthetic import make_sample
from harness.seaweed import SeaweedServer, WeedNotFoundError, _free_ports

REMOTE_ROWS = 96  # a few batches at any batch size used here; small enough to write in about a second
HEIGHT, WIDTH = 40, 56  # the same shape as the local test dataset (conftest)
BUCKET = "asyncload-test"
#: The listening backlog of the loopback test servers (``serving``, the GCS emulator): socketserver's 5 drops
#: the SYNs of a loader's many connections at once.
BACKLOG = 256


@dataclass(frozen=True)
class RemoteData:
    """Where the remote copies are and what they hold."""

    server: SeaweedServer
    bucket: str
    deeplake_url: str  # s3://bucket/seg
    files_url: str  # s3://bucket/files (images/<stem>.png, masks/<stem>.png)
    images: np.ndarray  # [N, H, W, 3] uint8, the originals
    masks: np.ndarray  # [N, H, W] uint8

    @property
    def rows(self) -> int:
        return len(self.images)

    def creds(self) -> dict[str, str]:
        return self.server.creds(self.bucket)


def stem(i: int) -> str:
    return f"{i:06d}"


def png_bytes(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def upload_files(server: SeaweedServer, bucket: str, prefix: str, images: np.ndarray, masks: np.ndarray) -> None:
    """``<prefix>/images/<stem>.png`` (RGB) and ``<prefix>/masks/<stem>.png`` (grey) for every row."""
    jobs = [(f"{prefix}/images/{stem(i)}.png", images[i]) for i in range(len(images))]
    jobs += [(f"{prefix}/masks/{stem(i)}.png", masks[i]) for i in range(len(masks))]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda job: server.put_object(bucket, job[0], png_bytes(job[1])), jobs))


def originals(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The synthetic rows exactly as ``make_dataset(seed=0)`` writes them."""
    pairs = [make_sample(np.random.default_rng([0, i]), HEIGHT, WIDTH) for i in range(rows)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    """One SeaweedFS S3 server for the session (signatures checked), stopped at the end whatever happens."""
    try:
        server = SeaweedServer()
    except WeedNotFoundError as exc:
        pytest.skip(str(exc))
    with server:
        yield server


@pytest.fixture(scope="session")
def remote_data(seaweed: SeaweedServer) -> RemoteData:
    """The synthetic dataset on the server, as Deep Lake and as plain files (read-only for tests)."""
    seaweed.create_bucket(BUCKET)
    images, masks = originals(REMOTE_ROWS)
    url = make_dataset(
        f"s3://{BUCKET}/seg", REMOTE_ROWS, height=HEIGHT, width=WIDTH, creds=seaweed.creds(BUCKET), progress=False
    )
    upload_files(seaweed, BUCKET, "files", images, masks)
    return RemoteData(seaweed, BUCKET, url, f"s3://{BUCKET}/files", images, masks)


PROFILE = "asyncload-test"  # the profile aws_files writes with the server's real keys
WRONG_SECRET = "WRONG-secret-" + "p" * 27  # profile "wrong" has it


@pytest.fixture
def aws_files(remote_data: RemoteData, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Shared credentials and config files with three profiles; no other AWS setting in the environment."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # this machine has no instance metadata service
    server = remote_data.server
    (tmp_path / "credentials").write_text(
        f"[{PROFILE}]\naws_access_key_id = {server.access_key}\naws_secret_access_key = {server.secret_key}\n\n"
        f"[wrong]\naws_access_key_id = {server.access_key}\naws_secret_access_key = {WRONG_SECRET}\n"
    )
    counter = tmp_path / "process-calls"
    script = tmp_path / "creds_process.py"
    script.write_text(
        "import datetime as dt, json, sys\n"
        "open(sys.argv[1], 'a').write('x')\n"
        "exp = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=float(sys.argv[2]))\n"
        f"print(json.dumps({{'Version': 1, 'AccessKeyId': {server.access_key!r}, "
        f"'SecretAccessKey': {server.secret_key!r}, 'Expiration': exp.isoformat()}}))\n"
    )
    (tmp_path / "config").write_text(
        f"[profile {PROFILE}]\nregion = eu-west-3\nendpoint_url = {server.endpoint_url}\n\n"
        f"[profile wrong]\nendpoint_url = {server.endpoint_url}\n\n"
        # expires 603 s from each fetch: fresh for 3 s, then inside the 600 s renewal margin
        f"[profile process]\nendpoint_url = {server.endpoint_url}\n"
        f"credential_process = {sys.executable} {script} {counter} 603\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    return tmp_path


@pytest.fixture
def running_seaweed(seaweed: SeaweedServer) -> Iterator[SeaweedServer]:
    """The session server, guaranteed running before and after the test (for tests that stop it)."""
    seaweed.start()
    try:
        yield seaweed
    finally:
        seaweed.start()


def read_epoch(it: Iterator[dict], data: RemoteData, seen: list[int] | None = None) -> list[int]:
    """Consume ``it``; check every sample's pixels against the originals; return the indices seen."""
    seen = [] if seen is None else seen
    seen += check_epoch(it, data.images, data.masks)
    return seen


# -- GCS and Azure emulators ------------------------------------------------------------------------------------
# Real servers from the package registries, started here on free loopback ports and always stopped:
# ``gcp-storage-emulator`` (PyPI, installed next to this Python) speaks GCS's JSON API; Azurite's
# ``azurite-blob`` (npm, looked for in .venv/azurite, ./node_modules or on PATH) checks Shared Key
# signatures as Azure does.

AZURITE_ACCOUNT = "devstoreaccount1"
STORE_ROWS = 48  # rows per emulator dataset: a few batches, quick to upload one object at a time


@dataclass(frozen=True)
class EmulatedData:
    """A dataset of PNG files on an emulator: ``<url>/{images,masks}/<stem>.png`` and the originals."""

    url: str  # gs://bucket/files or az://container/files
    endpoint: str
    images: np.ndarray
    masks: np.ndarray
    creds: dict[str, str]

    @property
    def rows(self) -> int:
        return len(self.images)


class EmulatorProcess:
    """A server process on a free loopback port, in its own process group, stopped (TERM, then KILL) on
    :meth:`stop`; :meth:`wait_ready` polls ``ready()`` until it answers or the deadline passes."""

    def __init__(self, argv: list[str], port: int, log: Path) -> None:
        self.port = port
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_ready(self, ready: Callable[[], bool], deadline: float = 60.0) -> None:
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.proc.args[0]} exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}"
                )
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.proc.args[0]} did not answer on port {self.port} within {deadline:.0f}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue


def _http(
    method: str, port: int, path: str, body: bytes = b"", headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body if body or method in ("PUT", "POST") else None, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def find_tool(name: str, *candidates: Path) -> str | None:
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return str(c)
    return shutil.which(name)


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``gcp-storage-emulator`` on a free loopback port; yields its endpoint URL. Where this interpreter has
    its package, it runs here with the listening backlog raised (``BACKLOG``): the emulator serves on one
    thread with socketserver's backlog of 5, so a loader's 16 connections at once had SYNs dropped, resent
    after 1, 2 and 4 s, and the reads behind them timed out and were retried (an epoch of 64 rows took
    8-16 s instead of 1)."""
    exe = find_tool("gcp-storage-emulator", Path(sys.executable).parent / "gcp-storage-emulator")
    if exe is None:
        pytest.skip("gcp-storage-emulator is not installed: pip install gcp-storage-emulator (the test extra)")
    if importlib.util.find_spec("gcp_storage_emulator") is not None:
        code = (f"import socketserver, sys; socketserver.TCPServer.request_queue_size = {BACKLOG}; "
                "from gcp_storage_emulator.__main__ import main; sys.exit(main())")  # fmt: skip
        cmd = [sys.executable, "-c", code]
    else:
        cmd = [exe]
    (port,) = _free_ports("127.0.0.1", 1)
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    server = EmulatorProcess(
        [*cmd, "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory", "-q"], port, log
    )
    try:
        server.wait_ready(lambda: _http("GET", port, "/storage/v1/b?project=test")[0] == 200)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_data(gcs_emulator: str) -> EmulatedData:
    """The synthetic rows as PNG files in bucket ``asyncload-gcs`` (read-only for tests)."""
    port = int(gcs_emulator.rsplit(":", 1)[1])
    bucket = "asyncload-gcs"
    status, body = _http("POST", port, "/storage/v1/b?project=test", json.dumps({"name": bucket}).encode(),
                         {"Content-Type": "application/json"})  # fmt: skip
    assert status == 200, body
    images, masks = originals(STORE_ROWS)

    def put(key: str, data: bytes) -> None:
        path = f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={quote(key, safe='')}"
        status, body = _http("POST", port, path, data, {"Content-Type": "image/png"})
        assert status == 200, body

    for i in range(STORE_ROWS):
        put(f"files/images/{stem(i)}.png", png_bytes(images[i]))
        put(f"files/masks/{stem(i)}.png", png_bytes(masks[i]))
    put("files/manifest.txt", "\n".join(stem(i) for i in (9, 2, 40)).encode())
    creds = {"endpoint_url": gcs_emulator, "anonymous": "true"}  # the emulator checks no credentials
    return EmulatedData(f"gs://{bucket}/files", gcs_emulator, images, masks, creds)


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Azurite's Blob service on a free loopback port; yields the account's endpoint URL (path style)."""
    root = Path(__file__).resolve().parent.parent
    exe = find_tool(
        "azurite-blob",
        Path(sys.executable).parent.parent / "azurite/node_modules/.bin/azurite-blob",
        root / "node_modules/.bin/azurite-blob",
    )
    if exe is None:
        pytest.skip("azurite-blob is not installed: npm install --prefix .venv/azurite azurite (make test does)")
    (port,) = _free_ports("127.0.0.1", 1)
    where = tmp_path_factory.mktemp("azurite")
    argv = [exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(where),
            "--skipApiVersionCheck", "--silent", "--disableTelemetry"]  # fmt: skip
    server = EmulatorProcess(argv, port, where / "azurite.log")
    try:
        server.wait_ready(lambda: _http("GET", port, f"/{AZURITE_ACCOUNT}?comp=list")[0] in (200, 403))
        yield f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"
    finally:
        server.stop()


def azure_request(
    endpoint: str, method: str, path: str, body: bytes = b"", extra: dict[str, str] | None = None
) -> None:
    """One Shared Key-signed request to Azurite (setup only), signed by asyncload's own signer."""
    from asyncload.sources.stores.azure import _AZURITE_KEY, API_VERSION, SharedKey

    url = f"{endpoint}{path}"
    headers = {"x-ms-date": email.utils.formatdate(usegmt=True), "x-ms-version": API_VERSION, **(extra or {})}
    headers["Authorization"] = SharedKey(AZURITE_ACCOUNT, _AZURITE_KEY).sign(method, url, headers, len(body))
    port = int(endpoint.split(":")[2].split("/")[0])
    status, text = _http(method, port, urlsplit(url).path + (f"?{urlsplit(url).query}" if urlsplit(url).query else ""),
                         body, headers | {"Content-Length": str(len(body))})  # fmt: skip
    assert status in (200, 201), (status, text[:300])


@pytest.fixture(scope="session")
def azure_data(azurite: str) -> EmulatedData:
    """The synthetic rows as PNG blobs in container ``asyncload-az`` (read-only for tests)."""
    from asyncload.sources.stores.azure import _AZURITE_KEY

    container = "asyncload-az"
    azure_request(azurite, "PUT", f"/{container}?restype=container")
    images, masks = originals(STORE_ROWS)
    blob = {"x-ms-blob-type": "BlockBlob"}
    for i in range(STORE_ROWS):
        azure_request(azurite, "PUT", f"/{container}/files/images/{stem(i)}.png", png_bytes(images[i]), blob)
        azure_request(azurite, "PUT", f"/{container}/files/masks/{stem(i)}.png", png_bytes(masks[i]), blob)
    azure_request(azurite, "PUT", f"/{container}/files/manifest.txt",
                  "\n".join(stem(i) for i in (9, 2, 40)).encode(), blob)  # fmt: skip
    creds = {"account_name": AZURITE_ACCOUNT, "account_key": _AZURITE_KEY, "endpoint_url": azurite}
    return EmulatedData(f"az://{container}/files", azurite, images, masks, creds)


def check_epoch(it: Iterator[dict], images: np.ndarray, masks: np.ndarray) -> list[int]:
    """Consume ``it``; check every sample's pixels; return the indices seen (for multiset checks)."""
    seen: list[int] = []
    for b in it:
        idx = b["index"].tolist()
        for j, i in enumerate(idx):
            assert np.array_equal(b["images"][j].numpy(), images[i]), f"images differ at index {i}"
            assert np.array_equal(b["masks"][j].numpy(), masks[i]), f"masks differ at index {i}"
        seen += idx
    return seen


def reply(
    handler: BaseHTTPRequestHandler, body: bytes, status: int = 200, headers: dict[str, str] | None = None
) -> None:
    """Answer a request of a loopback test server with ``body`` (length set, extra ``headers``)."""
    handler.send_response(status)
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


@contextlib.contextmanager
def serving(server: ThreadingHTTPServer) -> Iterator[str]:
    """Serve on a thread until the block ends; yields ``http://127.0.0.1:<port>``. The listening backlog is
    raised from socketserver's 5: a loader opens 16 and more connections at once, and each connection past
    the backlog had its SYN dropped and sent again after TCP's first retransmission timeout (1 s), which
    took most of a 40-row epoch (reads of 1.0-1.2 s at the 90th percentile, against 14 ms at the median)."""
    server.daemon_threads = True
    server.socket.listen(BACKLOG)  # (listen again: Linux takes the new backlog on a listening socket)
    thread = threading.Thread(target=server.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
