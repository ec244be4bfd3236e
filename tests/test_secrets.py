"""Secrets stay secret, TLS is verified unless turned off on purpose, and nothing read from a store is
unpickled.

Against a real SeaweedFS server that checks signatures, with its real secret key:

- the secret is in no ``repr()``/``str()`` of the public objects (``DeepLakeSource``,
  ``ObjectStoreSource``, ``AsyncLoader``, ``AsyncIterableDataset``), in no error a user can meet (wrong
  credentials, missing bucket, endpoint down, a read denied mid-epoch, for both sources; the whole chain
  of ``__cause__``/``__context__`` as a traceback prints it), in ``loader.stats()``, and in no log record
  emitted at DEBUG level during runs that succeed, skip and fail;
- pickled sources *do* carry the credentials, on purpose: a spawned DataLoader worker gets the source by
  pickle and must reopen the store with them. The test pins that down so nobody "fixes" it by accident,
  and checks that the copy's repr is still clean;
- TLS: ``ObjectStoreSource`` verifies certificates by default (a real HTTPS server on loopback with a
  self-signed certificate is refused at once, not retried); only an explicit ``verify_tls=False`` or a CA
  bundle path lets it through;
- the modules on the read paths of ``ObjectStoreSource`` and ``DeepLakeSource`` (found by following their
  imports inside asyncload) import no pickle-like module and call no ``torch.load``/``np.load``: bytes
  from a store are only ever decoded as images (Pillow) or by Deep Lake itself. Deep Lake's own reader is
  outside this check.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import pickle
import shutil
import ssl
import subprocess
import threading
import traceback
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource, ObjectStoreSource, ReadError, SourceError
from asyncload.sources.stores.http import ssl_option
from asyncload.sources.stores.retry import RetryPolicy
from harness.faults import Fault, FaultProxy
from harness.seaweed import SeaweedServer, _free_ports

from .remote_fixtures import PROFILE, EmulatedData, RemoteData, png_bytes, stem

WRONG_SECRET = "WRONG-secret-" + "q" * 27


def full_text(exc: BaseException) -> str:
    """Everything a user could see of ``exc``: message, repr, args and the printed chain."""
    return "".join(traceback.format_exception(exc)) + repr(exc) + repr(exc.args)


def make_sources(data: RemoteData, creds: dict[str, str], *, bucket: str | None = None) -> dict[str, Callable[[], Any]]:
    b = bucket or data.bucket
    return {
        "deeplake": lambda: DeepLakeSource(f"s3://{b}/seg", creds=creds),
        "objectstore": lambda: ObjectStoreSource(f"s3://{b}/files", creds=creds),
    }


# -- reprs, stats ------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_no_secret_in_reprs_or_stats(remote_data: RemoteData) -> None:
    secret = remote_data.server.secret_key
    for kind, make in make_sources(remote_data, remote_data.creds()).items():
        src = make().open()
        loader = AsyncLoader(src, batch_size=16, concurrency=16)
        ds = AsyncIterableDataset(src, batch_size=16, concurrency=16)
        n = sum(len(b["index"]) for b in loader)
        assert n == remote_data.rows
        for obj in (src, loader, ds, src.handle()):
            assert secret not in repr(obj) and secret not in str(obj), (kind, type(obj).__name__)
        assert secret not in repr(loader.stats()), kind
        if isinstance(src, ObjectStoreSource):
            assert secret not in repr(src.retry_stats())


@pytest.mark.timeout(60)
def test_pickled_sources_carry_credentials_on_purpose(remote_data: RemoteData) -> None:
    """By design: a spawned DataLoader worker receives the source by pickle and reopens the store with the
    credentials inside it. Treat pickles of a source like the credentials themselves."""
    secret = remote_data.server.secret_key
    for kind, make in make_sources(remote_data, remote_data.creds()).items():
        src = make().open()
        blob = pickle.dumps(src)
        assert secret.encode() in blob, f"{kind}: a pickled source must carry its credentials to reopen"
        copy = pickle.loads(blob)
        assert copy._handle_obj is None  # the live handle is never pickled; the copy reopens
        assert len(copy) == remote_data.rows
        assert secret not in repr(copy)


# -- errors ------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["deeplake", "objectstore"])
def test_no_secret_in_open_errors(remote_data: RemoteData, kind: str) -> None:
    """Wrong secret, missing bucket, endpoint down: the message and its whole chain stay clean."""
    secret = remote_data.server.secret_key
    (dead,) = _free_ports("127.0.0.1", 1)
    cases = {
        "wrong secret": make_sources(remote_data, dict(remote_data.creds(), aws_secret_access_key=WRONG_SECRET))[kind],
        "missing bucket": make_sources(remote_data, remote_data.creds(), bucket="no-such-bucket")[kind],
        "endpoint down": make_sources(remote_data, dict(remote_data.creds(), endpoint_url=f"http://127.0.0.1:{dead}"))[
            kind
        ],
    }
    for case, make in cases.items():
        with pytest.raises(SourceError) as info:
            make().open()
        text = full_text(info.value)
        assert secret not in text and WRONG_SECRET not in text, f"{kind}, {case}: {text}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["deeplake", "objectstore"])
def test_no_secret_in_read_errors_or_skip_reports(
    remote_data: RemoteData, running_seaweed: SeaweedServer, kind: str
) -> None:
    """A read denied mid-epoch (403 from a proxy in front of the real server): raised, and skipped."""
    secret = remote_data.server.secret_key
    with FaultProxy(("127.0.0.1", running_seaweed.port)) as proxy:
        creds = dict(remote_data.creds(), endpoint_url=proxy.url)
        src = make_sources(remote_data, creds)[kind]().open()
        proxy.schedule.always(Fault.HTTP_403, match="/seg/" if kind == "deeplake" else f"images/{stem(5)}.png")
        # Deep Lake's reader process opens the dataset itself, behind the proxy: its open is denied too
        # closed by the with: a loader whose reader process was denied its open outlives a gc.collect()
        # (seen after this test: its reader alive until the session's end; see the closing note of 2026-11-27)
        with pytest.raises((ReadError, SourceError) if kind == "deeplake" else ReadError) as info:
            with AsyncLoader(src, batch_size=8, concurrency=8) as loader:
                for _ in loader:
                    pass
        assert secret not in full_text(info.value)
        if kind == "objectstore":  # Deep Lake denies every chunk here, so skipping would skip everything
            loader = AsyncLoader(src, batch_size=8, concurrency=8, on_error="skip")
            n = sum(len(b["index"]) for b in loader)
            stats = loader.stats()
            assert n == remote_data.rows - 1 and stats["skipped"] == 1
            assert secret not in repr(stats)


# -- logs ---------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_no_secret_in_debug_logs(
    remote_data: RemoteData, running_seaweed: SeaweedServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Every record any logger emits at DEBUG during successful, skipping and failing runs of both sources."""
    secret = remote_data.server.secret_key
    caplog.set_level(logging.DEBUG)  # the root logger: asyncload, aiohttp, asyncio, anything that propagates
    for make in make_sources(remote_data, remote_data.creds()).values():  # plain successful runs
        loader = AsyncLoader(make(), batch_size=16, concurrency=32, log_every=0.05)
        assert sum(len(b["index"]) for b in loader) == remote_data.rows
    with FaultProxy(("127.0.0.1", running_seaweed.port)) as proxy:
        creds = dict(remote_data.creds(), endpoint_url=proxy.url)
        proxy.schedule.burst(Fault.SLOW_DOWN, 10, match="/files/")  # retried, and logged if anything is
        proxy.schedule.always(Fault.HTTP_500, match=f"masks/{stem(3)}.png")  # fails for good
        quick = RetryPolicy(max_attempts=2, base_delay=0.01, max_delay=0.02)
        src = ObjectStoreSource(remote_data.files_url, creds=creds, retry=quick)
        # cache=False: the runs above kept these objects on the node store; the faults are in the store's path
        skipping = AsyncLoader(src, batch_size=16, concurrency=32, on_error="skip", cache=False)
        assert sum(len(b["index"]) for b in skipping) == remote_data.rows - 1
        with pytest.raises(ReadError):
            list(AsyncLoader(src, batch_size=16, concurrency=32, cache=False))
        deeplake = AsyncLoader(
            DeepLakeSource(remote_data.deeplake_url, creds=creds), batch_size=16, concurrency=32, cache=False
        )
        assert sum(len(b["index"]) for b in deeplake) == remote_data.rows
    with pytest.raises(SourceError):
        ObjectStoreSource(
            remote_data.files_url, creds=dict(remote_data.creds(), aws_secret_access_key=WRONG_SECRET)
        ).open()
    assert len(caplog.records) > 0
    assert any(r.name == "asyncload" and "skipped 1 samples" in r.getMessage() for r in caplog.records)
    for r in caplog.records:
        text = r.getMessage() + repr(r.args)
        if r.exc_info and r.exc_info[1] is not None:
            text += full_text(r.exc_info[1])
        assert secret not in text and WRONG_SECRET not in text, f"{r.name}:{r.levelname}: {text[:500]}"


@pytest.mark.timeout(60)
def test_no_secret_from_a_profile_or_an_azure_key_in_reprs_errors_or_logs(
    remote_data: RemoteData, aws_files: Path, azure_data: EmulatedData, caplog: pytest.LogCaptureFixture
) -> None:
    """Credentials found by the chain (a profile in a shared credentials file, read by botocore, which logs
    at DEBUG) and an Azure account key (a Shared Key signer): in no repr of the source, its store, its
    endpoint or the renewing credential; in no error of a refused key; in no log record."""
    from .remote_fixtures import WRONG_SECRET

    secrets = [remote_data.server.secret_key, WRONG_SECRET, azure_data.creds["account_key"]]
    caplog.set_level(logging.DEBUG)
    src = ObjectStoreSource(remote_data.files_url, profile=PROFILE)
    assert sum(len(b["index"]) for b in AsyncLoader(src, batch_size=16, concurrency=16)) == remote_data.rows
    store = src.store()
    az = ObjectStoreSource(azure_data.url, creds=azure_data.creds)
    assert sum(len(b["index"]) for b in AsyncLoader(az, batch_size=16, concurrency=16)) == azure_data.rows
    texts = [repr(src), repr(store), repr(store.s3), repr(store.s3._renewing), repr(store.s3.credentials),
             repr(az), repr(az.store()), repr(az.store()._auth)]  # fmt: skip
    for make in (
        lambda: ObjectStoreSource(remote_data.files_url, profile="wrong").open(),
        lambda: ObjectStoreSource(azure_data.url, creds=dict(azure_data.creds, account_key="A" * 88)).open(),
    ):
        with pytest.raises(SourceError) as info:
            make()
        texts.append(full_text(info.value))
    for r in caplog.records:
        texts.append(r.getMessage() + repr(r.args))
    for text in texts:
        for secret in secrets:
            assert secret not in text, text[:500]


# -- TLS --------------------------------------------------------------------------------------------------------------


def test_tls_verification_is_on_by_default_and_off_only_explicitly() -> None:
    default = inspect.signature(ObjectStoreSource).parameters["verify_tls"].default
    assert default is True
    src = ObjectStoreSource("https://example.invalid/data", manifest=["a"])
    assert src.verify_tls is True
    assert ssl_option(True) is True and ssl_option(False) is False  # aiohttp's ssl=: True verifies (system CAs)


@pytest.fixture
def https_files(tmp_path: Path) -> Iterator[tuple[str, Path, np.ndarray]]:
    """A real HTTPS server on loopback with a self-signed certificate, serving one image/mask pair."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make a self-signed certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    root = tmp_path / "www"
    rng = np.random.default_rng(0)
    image = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    for col, arr in (("images", image), ("masks", image[..., 0])):
        (root / "files" / col).mkdir(parents=True)
        (root / "files" / col / "000000.png").write_bytes(png_bytes(arr))

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, directory=str(root), **kw)

        def log_message(self, *args: Any) -> None:
            pass

    class Server(ThreadingHTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            pass  # refused handshakes are the point of the test

    httpd = Server(("127.0.0.1", 0), Quiet)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True)
    thread = threading.Thread(target=httpd.serve_forever, name="https-test", daemon=True)
    thread.start()
    try:
        yield f"https://127.0.0.1:{httpd.server_address[1]}/files", cert, image
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.mark.timeout(60)
def test_untrusted_certificate_is_refused_at_once_unless_explicitly_allowed(
    https_files: tuple[str, Path, np.ndarray],
) -> None:
    url, cert, image = https_files
    src = ObjectStoreSource(url, manifest=["000000"])
    with pytest.raises(ReadError) as info:
        next(iter(AsyncLoader(src, batch_size=1)))
    text = full_text(info.value)
    assert "certificate" in text.lower(), text
    assert src.retry_stats()["retries"] == 0  # a certificate does not fix itself: not retried
    for verify in (str(cert), False):  # a CA bundle, or verification explicitly off
        batch = next(iter(AsyncLoader(ObjectStoreSource(url, manifest=["000000"], verify_tls=verify), batch_size=1)))
        assert np.array_equal(batch["images"][0].numpy(), image)


@pytest.mark.timeout(60)
def test_a_probes_request_keeps_the_tls_policy_of_the_sessions(https_files: tuple[str, Path, np.ndarray]) -> None:
    """A bucket's probe sends its one request with the standard library's client (``request_blocking``), not
    aiohttp's: it verifies as the sessions do, against the system's CAs by default (the self-signed
    certificate refused), against a given bundle alone, or not at all when told; a non-2xx answer is an
    ``HTTPStatusError`` with its status, and headers are looked up regardless of case."""
    from asyncload.sources.stores.http import HTTPStatusError, Timeouts, request_blocking

    url, cert, _ = https_files
    timeouts = Timeouts(connect=2.0, read=5.0, total=5.0)
    with pytest.raises(ssl.SSLCertVerificationError):
        request_blocking("GET", f"{url}/images/000000.png", {}, timeouts, True)
    for verify in (str(cert), False):
        body, headers = request_blocking("GET", f"{url}/images/000000.png", {}, timeouts, verify)
        assert body.startswith(b"\x89PNG") and headers.get("content-type") == "image/png"
    with pytest.raises(HTTPStatusError) as info:
        request_blocking("GET", f"{url}/images/missing.png", {}, timeouts, False)
    assert info.value.status == 404


# -- no unpickling of store data ----------------------------------------------------------------------------------

PICKLE_LIKE = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal", "copyreg"}


def _asyncload_imports(module: str) -> set[str]:
    """asyncload modules that ``module`` imports (absolute names), from its source."""
    mod = importlib.import_module(module)
    tree = ast.parse(inspect.getsource(mod))
    package = module if hasattr(mod, "__path__") else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if target.startswith("asyncload"):
                found.add(target)
                for alias in node.names:  # "from . import x" may name a module
                    try:
                        importlib.import_module(f"{target}.{alias.name}")
                        found.add(f"{target}.{alias.name}")
                    except ImportError:
                        pass
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("asyncload"))
    return found


def read_path_modules() -> set[str]:
    """The source modules and everything inside asyncload they import, transitively."""
    todo = ["asyncload.sources.objectstore", "asyncload.sources.deeplake"]
    seen: set[str] = set()
    while todo:
        m = todo.pop()
        if m in seen or m == "asyncload":
            continue
        seen.add(m)
        todo += sorted(_asyncload_imports(m) - seen)
    return seen


#: Modules on the read paths allowed to import pickle, and why: ``errors.portable`` round-trips an
#: *exception object of this process* to check that it can cross to another one; no store byte reaches it.
PICKLE_OK = {"asyncload.errors"}


def test_read_paths_never_unpickle() -> None:
    modules = read_path_modules()
    assert {"asyncload.sources.objectstore", "asyncload.sources.deeplake", "asyncload.sources.stores.http"} <= modules
    assert {
        "asyncload.sources.stores.gcs",
        "asyncload.sources.stores.azure",
        "asyncload.sources.stores.creds",
    } <= modules
    for name in sorted(modules - PICKLE_OK):
        tree = ast.parse(inspect.getsource(importlib.import_module(name)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                bad = {a.name.split(".")[0] for a in node.names} & PICKLE_LIKE
                assert not bad, f"{name} imports {bad}"
            elif isinstance(node, ast.ImportFrom) and not node.level:
                assert (node.module or "").split(".")[0] not in PICKLE_LIKE, f"{name} imports from {node.module}"
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load":
                owner = ast.unparse(node.func.value)
                assert owner not in ("torch", "np", "numpy"), f"{name} calls {owner}.load (may unpickle)"
            elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                raise AssertionError(f"{name} passes allow_pickle")


def test_decoding_store_bytes_is_image_decoding_only() -> None:
    """A pickle payload where an image is expected is an undecodable image, not an object."""
    from asyncload.image.files import decode_image

    payload = pickle.dumps({"not": "an image"})
    with pytest.raises(ValueError, match="cannot decode"):
        decode_image(payload, "rgb", "s3://bucket/evil.png")
    assert decode_image(png_bytes(np.zeros((4, 4, 3), np.uint8)), "rgb", "x").shape == (4, 4, 3)
