"""``harness.s3log.RequestLog``, the logging proxy that says what each process reads from an S3 server
(issue 61): against the suite's real SeaweedFS, each request is logged under the port it came in on, with
its key and ``Range``, and its answer's bytes add up to every byte the client received, headers included
(what a counter at the server's port sees). A Deep Lake dataset opened through it shows its reads by kind."""

from __future__ import annotations

import hashlib
import http.client
import socket

import pytest

from asyncload.sources.stores.sigv4 import Credentials, SigV4Signer
from harness.s3log import RequestLog
from harness.seaweed import SeaweedServer

from .remote_fixtures import RemoteData

pytestmark = pytest.mark.timeout(60)


def raw_get(server: SeaweedServer, port: int, path: str, headers: dict[str, str], n: int) -> int:
    """``n`` signed GETs of ``path`` on one keep-alive connection to ``port``; the bytes received."""
    url = f"http://127.0.0.1:{port}{path}"
    signer = SigV4Signer(Credentials(server.access_key, server.secret_key), server.region)
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    got = 0
    try:
        for _ in range(n):
            signed = signer.sign("GET", url, payload_hash=hashlib.sha256(b"").hexdigest()) | headers
            head = f"GET {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in signed.items()) + "\r\n"
            sock.sendall(head.encode())
            resp = http.client.HTTPResponse(sock)
            resp.begin()
            body = resp.read()
            got += len(body)
            assert resp.status in (200, 206), (resp.status, body[:200])
    finally:
        sock.close()
    return got


def test_each_request_is_logged_under_its_port_with_its_range_and_bytes(seaweed: SeaweedServer) -> None:
    seaweed.create_bucket("s3log")
    seaweed.put_object("s3log", "ds/a/bc/object", bytes(range(256)) * 400)  # 102,400 bytes
    with RequestLog(("127.0.0.1", seaweed.port), ["p0", "p1"]) as proxy:
        ports = {lab: int(proxy.url(lab).rsplit(":", 1)[1]) for lab in ("p0", "p1")}
        body0 = raw_get(seaweed, ports["p0"], "/s3log/ds/a/bc/object", {"Range": "bytes=100-4195"}, 3)
        body1 = raw_get(seaweed, ports["p1"], "/s3log/ds/a/bc/object", {}, 1)
        got = proxy.entries()
    assert (body0, body1) == (3 * 4096, 102_400)
    assert [(e.label, e.method, e.key, e.range, e.status, e.length) for e in got] == [
        ("p0", "GET", "ds/a/bc/object", "bytes=100-4195", 206, 4096),
    ] * 3 + [("p1", "GET", "ds/a/bc/object", None, 200, 102_400)]
    assert len({e.conn for e in got[:3]}) == 1 and got[3].conn != got[0].conn  # one keep-alive connection each
    for e in got:  # the answer's bytes: its head and its body, each answer on its own
        assert e.length is not None and 0 < e.received - e.length < 1000


def test_a_deep_lake_read_through_it_shows_the_open_the_header_and_the_pages(remote_data: RemoteData) -> None:
    import deeplake

    from benchmarks.suites.per_process_reads import kind

    server = remote_data.server
    with RequestLog(("127.0.0.1", server.port), ["r0"]) as proxy:
        ds = deeplake.open_read_only(remote_data.deeplake_url, creds=server.creds() | {"endpoint_url": proxy.url("r0")})
        rows = ds["images"].get_bytes_async([0, 1, 2]).result()
        del ds
        got = proxy.entries()
    kinds = {kind(e.key, e.method, e.range) for e in got}
    assert {"open: version log", "data file header", "pages"} <= kinds, kinds
    pages = sum(e.received for e in got if kind(e.key, e.method, e.range) == "pages")
    assert pages >= sum(len(r) for r in rows)  # a page holds the rows asked for, and usually more
    assert all(e.status in (200, 206) for e in got)
