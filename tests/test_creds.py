"""S3 credentials and regions the standard way, against the real SeaweedFS server (signatures checked),
through botocore's chain: profiles from shared credentials and config files written here
(``AWS_SHARED_CREDENTIALS_FILE``, ``AWS_CONFIG_FILE``), ``profile=`` and ``AWS_PROFILE``, a
``credential_process`` whose keys expire and are renewed mid-run, an instance role (a loopback metadata
service), web identity (a loopback STS), SSO (a cached login and a loopback portal); clear errors for a
wrong or unknown profile; the region from configuration and from the bucket's own answer.

SeaweedFS does not send ``x-amz-bucket-region`` (checked: neither on a list nor on HEAD bucket), so that
case runs through a small reverse proxy in front of it that behaves as AWS does: every answer names the
bucket's region, and a request signed for another region is refused with ``AuthorizationHeaderMalformed``.
SeaweedFS also refuses session tokens it did not issue, so the loopback credential services hand out the
server's keys with an empty session token.
"""

from __future__ import annotations

import collections
import datetime as dt
import http.client
import json
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs

import deeplake
import pytest

from asyncload import AsyncLoader, ObjectStoreSource, SourceError
from asyncload.sources.stores.probe import S3AccessError, probe_s3_url
from harness.seaweed import _free_ports

from .remote_fixtures import PROFILE, WRONG_SECRET, RemoteData, read_epoch, reply, serving

pytestmark = pytest.mark.timeout(60)


def full_text(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc)) + repr(exc)


def test_profile_argument_reads_with_keys_and_region_from_the_files(remote_data: RemoteData, aws_files: Path) -> None:
    src = ObjectStoreSource(remote_data.files_url, profile=PROFILE)
    seen = read_epoch(iter(AsyncLoader(src, batch_size=16, shuffle=True, seed=5, concurrency=32)), remote_data)
    assert collections.Counter(seen) == collections.Counter(range(remote_data.rows))
    s3 = src.store().s3
    assert s3.region == "eu-west-3" and s3.region_pinned  # the profile's region (config file)
    assert s3.endpoint_url == remote_data.server.endpoint_url  # the profile's endpoint_url
    assert s3.source == f"shared-credentials-file, profile {PROFILE!r}"
    assert remote_data.server.secret_key not in repr(src.store()) + repr(s3)


def test_aws_profile_variable_and_the_probe_for_deeplake_urls(
    remote_data: RemoteData, aws_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_PROFILE", PROFILE)
    assert len(ObjectStoreSource(remote_data.files_url)) == remote_data.rows
    s3 = probe_s3_url(remote_data.deeplake_url)  # what DeepLakeSource runs before Deep Lake opens s3://
    assert s3.region == "eu-west-3" and s3.signed
    assert probe_s3_url(remote_data.deeplake_url, profile=PROFILE).region == "eu-west-3"
    ds = deeplake.open_read_only(remote_data.deeplake_url, creds=s3.as_creds())  # the chain's keys, to Deep Lake
    assert len(ds) == remote_data.rows


def test_deeplake_source_reads_with_a_profile_and_with_the_chain(
    remote_data: RemoteData, aws_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No keys anywhere but the shared files: DeepLakeSource asks the chain and hands Deep Lake its keys."""
    from asyncload import DeepLakeSource

    loader = AsyncLoader(DeepLakeSource(remote_data.deeplake_url, profile=PROFILE), batch_size=16, concurrency=16)
    assert sorted(i for b in loader for i in b["index"].tolist()) == list(range(remote_data.rows))
    monkeypatch.setenv("AWS_PROFILE", PROFILE)
    assert len(AsyncLoader(DeepLakeSource(remote_data.deeplake_url, probe=False)).source) == remote_data.rows
    with pytest.raises(SourceError) as e:
        AsyncLoader(DeepLakeSource(remote_data.deeplake_url, profile="wrong"))
    assert "rejected the credentials" in str(e.value) and WRONG_SECRET not in full_text(e.value)


def test_a_reader_process_opens_s3_with_what_was_checked_here_and_no_http_client_of_its_own(
    remote_data: RemoteData, aws_files: Path
) -> None:
    """The training process probes the bucket and resolves the profile once; its reader process is handed
    the keys and opens Deep Lake with them, without a probe, a credential chain or aiohttp of its own (whose
    import was the largest part of a reader's start). A probe that fails starts no reader at all."""
    from asyncload import DeepLakeSource

    from .conftest import live_children

    with AsyncLoader(
        DeepLakeSource(remote_data.deeplake_url, profile=PROFILE), batch_size=16, concurrency=16
    ) as loader:
        got = sorted(i for b in loader for i in b["index"].tolist())
        maps = Path(f"/proc/{loader._isolated.pid}/maps").read_text()
    assert got == list(range(remote_data.rows))
    assert "_deeplake" in maps and "aiohttp" not in maps  # its C parts: the parser, the masks
    before = {p.pid for p in live_children()}
    with pytest.raises(S3AccessError, match="rejected the credentials"):
        AsyncLoader(DeepLakeSource(remote_data.deeplake_url, profile="wrong"))
    assert {p.pid for p in live_children()} <= before


def test_wrong_secret_in_a_profile_fails_fast_naming_profile_endpoint_and_bucket(
    remote_data: RemoteData, aws_files: Path
) -> None:
    t0 = time.monotonic()
    with pytest.raises(S3AccessError) as info:
        ObjectStoreSource(remote_data.files_url, profile="wrong").open()
    assert time.monotonic() - t0 < 5.0
    msg = str(info.value)
    assert "SignatureDoesNotMatch" in msg and "profile 'wrong'" in msg
    assert remote_data.server.endpoint_url in msg and repr(remote_data.bucket) in msg
    text = full_text(info.value)
    assert WRONG_SECRET not in text and remote_data.server.secret_key not in text


def test_unknown_profile_fails_at_once_naming_it(remote_data: RemoteData, aws_files: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(SourceError, match="'no-such-profile'") as info:
        ObjectStoreSource(remote_data.files_url, profile="no-such-profile").open()
    assert time.monotonic() - t0 < 5.0
    assert str(aws_files / "config") in str(info.value)


def test_expiring_credentials_are_renewed_before_they_expire(remote_data: RemoteData, aws_files: Path) -> None:
    """``credential_process`` keys that expire 603 s after each fetch: fresh for 3 s, then inside the 600 s
    margin, so the next request renews them (in a worker thread) and every read still succeeds."""
    src = ObjectStoreSource(remote_data.files_url, profile="process")
    loader = AsyncLoader(src, batch_size=16, concurrency=16, cache=False)  # (the second epoch from the store)
    calls_at_open = len((aws_files / "process-calls").read_text())
    first = read_epoch(iter(loader), remote_data)
    calls_before = len((aws_files / "process-calls").read_text())
    assert src.store().s3._renewing is not None  # the process's keys expire: they are renewed, not kept
    assert calls_before == calls_at_open  # not renewed during the first epoch (fresh for 3 s)
    time.sleep(3.5)
    second = read_epoch(iter(loader), remote_data)
    assert sorted(first) == sorted(second) == list(range(remote_data.rows))
    assert len((aws_files / "process-calls").read_text()) > calls_before  # the process was asked again
    assert src.retry_stats()["gave_up"] == 0


def test_probe_can_be_turned_off(remote_data: RemoteData, aws_files: Path) -> None:
    """Without the probe a wrong key is met by the listing itself (a plain SourceError, not the probe's)."""
    with pytest.raises(SourceError) as info:
        ObjectStoreSource(remote_data.files_url, profile="wrong", probe=False).open()
    assert not isinstance(info.value, S3AccessError) and "cannot list" in str(info.value)
    (dead,) = _free_ports("127.0.0.1", 1)
    t0 = time.monotonic()
    s3 = probe_s3_url("s3://b/p", {"endpoint_url": f"http://127.0.0.1:{dead}"}, enabled=False)
    assert time.monotonic() - t0 < 1.0 and s3.endpoint_url.endswith(str(dead))  # no request was made


# -- the bucket's own region ------------------------------------------------------------------------------------

_SCOPE = re.compile(r"Credential=[^/]+/\d{8}/([^/]+)/s3/aws4_request")


class RegionProxy(ThreadingHTTPServer):
    """In front of SeaweedFS, answering as AWS does for a bucket in ``region``: ``x-amz-bucket-region`` on
    every answer, 400 ``AuthorizationHeaderMalformed`` for a request signed for another region."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int], region: str) -> None:
        self.upstream, self.region, self.scopes = upstream, region, []
        super().__init__(("127.0.0.1", 0), _RegionHandler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _RegionHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RegionProxy

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        match = _SCOPE.search(self.headers.get("Authorization", ""))
        scope = match.group(1) if match else None
        self.server.scopes.append(scope)
        if scope != self.server.region:
            body = (f"<Error><Code>AuthorizationHeaderMalformed</Code><Message>the region '{scope}' is wrong; "
                    f"expecting '{self.server.region}'</Message></Error>").encode()  # fmt: skip
            return self._answer(400, body, {})
        conn = http.client.HTTPConnection(*self.server.upstream, timeout=10)
        try:
            conn.putrequest("GET", self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():
                conn.putheader(k, v)
            conn.endheaders()
            resp = conn.getresponse()
            self._answer(resp.status, resp.read(), {"Content-Type": resp.getheader("Content-Type", "")})
        finally:
            conn.close()

    def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        reply(self, body, status, headers | {"x-amz-bucket-region": self.server.region})


@pytest.fixture
def region_proxy(remote_data: RemoteData) -> Iterator[RegionProxy]:
    proxy = RegionProxy(("127.0.0.1", remote_data.server.port), "eu-north-1")
    with serving(proxy):
        yield proxy


def test_region_comes_from_the_buckets_answer_when_none_is_configured(
    remote_data: RemoteData, aws_files: Path, region_proxy: RegionProxy
) -> None:
    creds = {k: v for k, v in remote_data.creds().items() if k != "aws_region"} | {"endpoint_url": region_proxy.url}
    src = ObjectStoreSource(remote_data.files_url, creds=creds)
    seen = read_epoch(iter(AsyncLoader(src, batch_size=16, concurrency=16)), remote_data)
    assert sorted(seen) == list(range(remote_data.rows))
    assert src.store().s3.region == "eu-north-1"
    assert region_proxy.scopes[0] == "us-east-1"  # the first probe, before the bucket named its region
    assert set(region_proxy.scopes[1:]) == {"eu-north-1"}
    assert src.retry_stats()["retries"] == 0


def test_a_configured_region_is_kept(remote_data: RemoteData, aws_files: Path, region_proxy: RegionProxy) -> None:
    """``aws_region`` says where the bucket is; the bucket disagreeing is an error naming the endpoint."""
    creds = dict(remote_data.creds(), endpoint_url=region_proxy.url, aws_region="ap-south-2")
    with pytest.raises(S3AccessError, match="AuthorizationHeaderMalformed") as info:
        ObjectStoreSource(remote_data.files_url, creds=creds).open()
    assert region_proxy.url in str(info.value)
    assert set(region_proxy.scopes) == {"ap-south-2"}


def test_credentials_and_expiry_dates_use_aware_times() -> None:
    """botocore hands back aware datetimes, google-auth naive UTC ones: both become the same instant."""
    from asyncload.sources.stores.creds import _epoch

    aware = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    assert _epoch(aware) == _epoch(aware.replace(tzinfo=None)) == aware.timestamp()
    assert _epoch(None) is None


@pytest.mark.asyncio
async def test_renewal_runs_once_off_the_loop_for_many_waiting_requests() -> None:
    """asyncload's Renewing with a plain fetch function: a credential inside its renewal margin is
    fetched again once for 50 concurrent requests, in a worker thread, never on the event loop's thread."""
    import asyncio
    import threading as th

    from asyncload.sources.stores.creds import Renewing

    calls: list[str] = []

    def fetch() -> tuple[str, float]:
        calls.append(th.current_thread().name)
        time.sleep(0.05)  # a token endpoint's round trip
        return f"token-{len(calls)}", time.time() + 0.3  # fresh for 0.3 s - margin

    renewing = Renewing(fetch, "test", margin_s=0.2)
    assert renewing.get_blocking() == "token-1"
    loop_thread = th.current_thread().name
    time.sleep(0.15)  # now inside the margin
    tokens = await asyncio.gather(*(renewing.get() for _ in range(50)))
    assert set(tokens) == {"token-2"} and len(calls) == 2  # renewed once
    assert calls[1] != loop_thread


def test_http_status_error_keeps_the_buckets_region_across_processes() -> None:
    import pickle

    from asyncload.sources.stores.http import HTTPStatusError

    err = HTTPStatusError(400, "Bad Request", "AuthorizationHeaderMalformed", "wrong region", None, "eu-north-1")
    back = pickle.loads(pickle.dumps(err))
    assert back.region == "eu-north-1" and str(back) == str(err)


# -- an instance role -------------------------------------------------------------------------------------------


class _Imds(BaseHTTPRequestHandler):
    """EC2's instance metadata service as botocore asks it (IMDSv2: a session token, then the role's keys)."""

    protocol_version = "HTTP/1.1"
    keys: tuple[str, str] = ("", "")
    asked: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, body: str, status: int = 200) -> None:
        reply(self, body.encode(), status)

    def do_PUT(self) -> None:
        self.asked.append(self.path)
        self._send("imds-session-token" if self.path == "/latest/api/token" else "", 200)

    def do_GET(self) -> None:
        self.asked.append(self.path)
        if self.headers.get("X-aws-ec2-metadata-token") != "imds-session-token":
            return self._send("", 401)
        base = "/latest/meta-data/iam/security-credentials/"
        if self.path == base:
            return self._send("asyncload-role")
        if self.path == base + "asyncload-role":
            expires = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
            access, secret = self.keys
            doc = {"Code": "Success", "Type": "AWS-HMAC", "AccessKeyId": access, "SecretAccessKey": secret,
                   "Token": "", "Expiration": expires}  # fmt: skip
            return self._send(json.dumps(doc))
        self._send("", 404)


def test_instance_role_credentials_from_the_metadata_service(
    remote_data: RemoteData, aws_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: no keys anywhere but an instance role. botocore's chain asks the metadata service
    (here a loopback one that hands out the server's keys with an expiry, and an empty session token since
    SeaweedFS refuses unknown ones), and reads are signed with them instead of going out unsigned (403)."""
    server = remote_data.server
    handler = type("Imds", (_Imds,), {"keys": (server.access_key, server.secret_key), "asked": []})
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as imds:
        monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
        monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds + "/")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(aws_files / "none"))
        monkeypatch.setenv("AWS_CONFIG_FILE", str(aws_files / "none"))
        src = ObjectStoreSource(remote_data.files_url, creds={"endpoint_url": server.endpoint_url})
        seen = read_epoch(iter(AsyncLoader(src, batch_size=16, concurrency=16)), remote_data)
        assert sorted(seen) == list(range(remote_data.rows))
        assert src.store().s3.source == "iam-role" and src.store().s3._renewing is not None
        assert "/latest/meta-data/iam/security-credentials/asyncload-role" in handler.asked


def test_without_botocore_the_aws_variables_still_work(remote_data: RemoteData) -> None:
    """botocore is the s3 extra: without it (hidden here in a fresh interpreter) keys in ``AWS_*`` still
    sign, and finding none says once why requests go unsigned."""
    code = (
        "import sys, logging; sys.modules['botocore'] = None\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        "from asyncload import ObjectStoreSource\n"
        "from asyncload.sources.stores.s3 import resolve_s3\n"
        f"print(len(ObjectStoreSource({remote_data.files_url!r})))\n"
        "import os; [os.environ.pop(k) for k in list(os.environ) if k.startswith('AWS_')]\n"
        "resolve_s3(); resolve_s3()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | remote_data.server.env()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(remote_data.rows)]
    assert out.stderr.count("botocore is not installed") == 1, out.stderr[-2000:]
    assert "pip install 'torch-asyncload[s3]'" in out.stderr, out.stderr[-2000:]  # the distribution's name


def test_every_missing_extra_names_the_distribution_torch_asyncload() -> None:
    """``asyncload`` on PyPI is another project: each message that asks for an extra names ours, in a fresh
    interpreter where the extra's package is hidden."""
    code = (
        "import sys\n"
        "for m in ('botocore', 'botocore.session', 'google', 'google.auth', 'azure.identity', 'lightning',\n"
        "          'lightning.pytorch'):\n"
        "    sys.modules[m] = None\n"
        "from asyncload.sources.stores import creds\n"
        "for call in (lambda: creds.aws_chain(None), lambda: creds.gcs_token(None), creds.azure_token):\n"
        "    try:\n"
        "        call()\n"
        "    except Exception as exc:\n"
        "        print(exc)\n"
        "try:\n"
        "    import asyncload.lightning\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert len(lines) == 4, out.stdout
    for line, extra in zip(lines, ("s3", "gcs", "azure", "lightning"), strict=True):
        assert f"pip install 'torch-asyncload[{extra}]'" in line, line
    assert "'asyncload[" not in out.stdout


# -- web identity (EKS, GitHub Actions, ...) --------------------------------------------------------------------


class _Sts(BaseHTTPRequestHandler):
    """STS's AssumeRoleWithWebIdentity as botocore calls it (a form POST), answering with the given keys."""

    keys: tuple[str, str] = ("", "")
    forms: list[dict[str, list[str]]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_POST(self) -> None:
        form = parse_qs(self.rfile.read(int(self.headers.get("Content-Length", "0"))).decode())
        self.forms.append(form)
        expires = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)).strftime("%Y-%m-%dT%H:%M:%SZ")
        access, secret = self.keys
        body = (
            '<AssumeRoleWithWebIdentityResponse xmlns="https://sts.amazonaws.com/doc/2011-06-15/">'
            "<AssumeRoleWithWebIdentityResult><Credentials>"
            f"<AccessKeyId>{access}</AccessKeyId><SecretAccessKey>{secret}</SecretAccessKey>"
            f"<SessionToken></SessionToken><Expiration>{expires}</Expiration></Credentials>"
            "<SubjectFromWebIdentityToken>ci</SubjectFromWebIdentityToken><AssumedRoleUser>"
            "<Arn>arn:aws:sts::123456789012:assumed-role/reader/asyncload</Arn><AssumedRoleId>AROA:asyncload</AssumedRoleId>"
            "</AssumedRoleUser></AssumeRoleWithWebIdentityResult>"
            "<ResponseMetadata><RequestId>1</RequestId></ResponseMetadata></AssumeRoleWithWebIdentityResponse>"
        ).encode()
        reply(self, body, headers={"Content-Type": "text/xml"})


def test_web_identity_credentials_through_sts(
    remote_data: RemoteData, aws_files: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AWS_ROLE_ARN`` + ``AWS_WEB_IDENTITY_TOKEN_FILE`` (as EKS and CI runners set them): botocore trades
    the token at STS (a loopback one, ``AWS_ENDPOINT_URL_STS``) for keys, and the reads are signed with them."""
    server = remote_data.server
    handler = type("Sts", (_Sts,), {"keys": (server.access_key, server.secret_key), "forms": []})
    token = aws_files / "web-identity-token"
    token.write_text("eyJ-a-web-identity-token")
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as sts:
        monkeypatch.setenv("AWS_ROLE_ARN", "arn:aws:iam::123456789012:role/reader")
        monkeypatch.setenv("AWS_WEB_IDENTITY_TOKEN_FILE", str(token))
        monkeypatch.setenv("AWS_ROLE_SESSION_NAME", "asyncload")
        monkeypatch.setenv("AWS_ENDPOINT_URL_STS", sts)
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        src = ObjectStoreSource(remote_data.files_url, creds={"endpoint_url": server.endpoint_url})
        assert len(src) == remote_data.rows
        assert src.store().s3.source == "assume-role-with-web-identity"
        (form,) = handler.forms
        assert form["Action"] == ["AssumeRoleWithWebIdentity"] and form["WebIdentityToken"] == [
            "eyJ-a-web-identity-token"
        ]


# -- SSO (IAM Identity Center) ----------------------------------------------------------------------------------


class _SsoPortal(BaseHTTPRequestHandler):
    """The SSO portal's GetRoleCredentials as botocore calls it, after ``aws sso login`` cached a token."""

    keys: tuple[str, str] = ("", "")
    asked: list[tuple[str, str | None]] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.asked.append((self.path, self.headers.get("x-amz-sso_bearer_token")))
        access, secret = self.keys
        expires_ms = int((time.time() + 3600) * 1000)
        body = json.dumps({"roleCredentials": {"accessKeyId": access, "secretAccessKey": secret,
                                               "sessionToken": "", "expiration": expires_ms}}).encode()  # fmt: skip
        reply(self, body, headers={"Content-Type": "application/json"})


def test_sso_profile_credentials_from_the_cached_login(remote_data: RemoteData, aws_files: Path) -> None:
    """A profile with ``sso_start_url`` etc.: botocore reads the token ``aws sso login`` cached under
    ~/.aws/sso/cache and asks the portal (a loopback one, ``AWS_ENDPOINT_URL_SSO``) for role keys."""
    import hashlib

    server = remote_data.server
    handler = type("Sso", (_SsoPortal,), {"keys": (server.access_key, server.secret_key), "asked": []})
    start_url = "https://asyncload.awsapps.com/start"
    home = aws_files / "home"
    cache = home / ".aws" / "sso" / "cache"
    cache.mkdir(parents=True)
    expires = (dt.datetime.now(dt.UTC) + dt.timedelta(hours=8)).strftime("%Y-%m-%dT%H:%M:%SZ")
    (cache / f"{hashlib.sha1(start_url.encode()).hexdigest()}.json").write_text(
        json.dumps(
            {"startUrl": start_url, "region": "eu-west-1", "accessToken": "sso-access-token", "expiresAt": expires}
        )
    )
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as portal:
        (aws_files / "config").write_text(
            f"[profile sso]\nsso_start_url = {start_url}\nsso_region = eu-west-1\nsso_account_id = 123456789012\n"
            f"sso_role_name = reader\nregion = eu-west-1\nendpoint_url = {server.endpoint_url}\n"
        )
        # botocore fixes ~/.aws/sso/cache when it is imported: a fresh interpreter with this HOME reads it.
        env = dict(os.environ, HOME=str(home), AWS_ENDPOINT_URL_SSO=portal)
        code = (
            "from asyncload import ObjectStoreSource\n"
            f"src = ObjectStoreSource({remote_data.files_url!r}, profile='sso')\n"
            "print(len(src)); print(src.store().s3.source)\n"
        )
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines() == [str(remote_data.rows), "sso, profile 'sso'"]
        path, bearer = handler.asked[0]
        assert path.startswith("/federation/credentials") and bearer == "sso-access-token"


def test_a_failing_credential_source_fails_the_open_naming_it(remote_data: RemoteData, aws_files: Path) -> None:
    """A ``credential_process`` that exits non-zero: a SourceError naming the profile, not botocore's own."""
    (aws_files / "config").write_text(
        f"[profile broken]\nendpoint_url = {remote_data.server.endpoint_url}\n"
        f"credential_process = {sys.executable} -c \"import sys; sys.exit('no credentials today')\"\n"
    )
    t0 = time.monotonic()
    with pytest.raises(SourceError, match="profile 'broken'") as info:
        ObjectStoreSource(remote_data.files_url, profile="broken").open()
    assert time.monotonic() - t0 < 5.0 and "no credentials today" in str(info.value)
