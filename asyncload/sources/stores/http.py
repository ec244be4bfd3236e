"""The HTTP client side shared by the remote sources: session settings, one request, its error.

Why these settings:

- **One pool, sized to the fan-out.** aiohttp's ``TCPConnector`` defaults to 100 connections, which
  silently queues requests beyond that inside the client; the pool is sized from the loader's hint so
  every request the loader issues gets a connection. Keep-alive reuses them across requests.
- **Three timeouts.** ``connect`` bounds the TCP (and TLS) handshake, ``read`` bounds the wait for the
  first byte and any stall between chunks, ``total`` bounds one attempt end to end. A dead peer is
  noticed within ``connect`` or ``read`` seconds instead of hanging a read forever.
- **TLS verified by default.** Turning verification off takes an explicit ``verify_tls=False``; a path
  gives a CA bundle instead.
- **A probe without aiohttp.** A bucket's probe is one request, sent with the standard library's client
  (``request_blocking``), which torch and Deep Lake import anyway: a training process that probes a Deep
  Lake bucket and reads it in a reader process then never imports aiohttp (0.24 s of CPU at each start:
  benchmarks/results/cpu/). aiohttp is imported where a session is made.
- **Errors keep the server's word.** A non-2xx answer becomes :class:`HTTPStatusError` with the status,
  the error code and message when the body is S3's or Azure's XML or GCS's JSON, ``Retry-After`` parsed,
  and S3's ``x-amz-bucket-region``, which is what the retry policy, the region lookup and the error
  messages need.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import re
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import aiohttp


@dataclass(frozen=True)
class Timeouts:
    """Seconds: ``connect`` (TCP+TLS handshake), ``read`` (first byte, and any stall), ``total`` (one attempt)."""

    connect: float = 3.0
    read: float = 10.0
    total: float = 60.0

    def client_timeout(self) -> aiohttp.ClientTimeout:
        import aiohttp

        # ``connect`` in aiohttp also counts waiting for a pooled connection; ``sock_connect`` is the
        # handshake alone, which is what a dead endpoint should be judged on.
        return aiohttp.ClientTimeout(total=self.total, sock_connect=self.connect, sock_read=self.read)


class HTTPStatusError(Exception):
    """A non-2xx answer. ``status``, the store's ``code`` and ``message`` when given, ``retry_after``
    seconds, and ``region``: the bucket's region when S3 named it (``x-amz-bucket-region``)."""

    def __init__(
        self,
        status: int,
        reason: str = "",
        code: str | None = None,
        message: str = "",
        retry_after: float | None = None,
        region: str | None = None,
    ) -> None:
        self.status = status
        self.reason = reason
        self.code = code
        self.message = message
        self.retry_after = retry_after
        self.region = region
        text = f"HTTP {status}"
        if code:
            text += f" {code}"
        elif reason:
            text += f" {reason}"
        if message:
            text += f": {message}"
        super().__init__(text)

    def __reduce__(self) -> tuple[Any, ...]:
        # ``args`` holds the formatted text, not the fields: rebuild from the fields across processes.
        return type(self), (self.status, self.reason, self.code, self.message, self.retry_after, self.region)

    @classmethod
    def from_response(cls, status: int, reason: str, headers: Mapping[str, str], body: bytes) -> HTTPStatusError:
        code, message = parse_error_body(body)
        retry_after = parse_retry_after(headers.get("Retry-After"))
        return cls(status, reason, code, message, retry_after, headers.get("x-amz-bucket-region"))


_CODE = re.compile(rb"<Code>([^<]{1,200})</Code>")
_MESSAGE = re.compile(rb"<Message>([^<]{0,500})</Message>")


def parse_error_body(body: bytes) -> tuple[str | None, str]:
    """``(code, message)`` from an S3/Azure XML error body (``<Code>``, ``<Message>``; Azure's message is
    cut at its first line, before the request id) or a GCS JSON one (``error.errors[0].reason``,
    ``error.message``); ``(None, "")`` for anything else."""
    head = body[:4096]
    if head.lstrip().startswith(b"{"):
        try:
            err = json.loads(body).get("error")
        except (ValueError, AttributeError):
            return None, ""
        if not isinstance(err, dict):
            return None, ""
        reasons = [e.get("reason") for e in err.get("errors", []) if isinstance(e, dict) and e.get("reason")]
        return (str(reasons[0]) if reasons else None), str(err.get("message", ""))[:500]
    code = _CODE.search(head)
    if code is None:
        return None, ""
    msg = _MESSAGE.search(head)
    text = msg.group(1).decode(errors="replace").split("\n", 1)[0] if msg else ""
    return code.group(1).decode(errors="replace"), text


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` as seconds from now (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def ssl_option(verify_tls: bool | str) -> ssl.SSLContext | bool:
    """aiohttp's ``ssl=``: True verifies (system CAs), a path verifies against that CA bundle, False does not."""
    if verify_tls is True:
        return True
    if verify_tls is False:
        return False
    return ssl.create_default_context(cafile=str(verify_tls))


def new_session(
    connections: int, timeouts: Timeouts, verify_tls: bool | str, keepalive_s: float = 30.0
) -> aiohttp.ClientSession:
    """A session with one pool of ``connections`` (no per-host cap), keep-alive, timeouts, TLS policy.

    Must be called on the loop that will use it.
    """
    import aiohttp

    connector = aiohttp.TCPConnector(
        limit=max(1, connections), limit_per_host=0, keepalive_timeout=keepalive_s,
        ssl=ssl_option(verify_tls), ttl_dns_cache=300,
    )  # fmt: skip
    return aiohttp.ClientSession(connector=connector, timeout=timeouts.client_timeout(), auto_decompress=False)


async def request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    headers: Mapping[str, str] | None = None,
    *,
    data: bytes | None = None,
    allow_redirects: bool = True,
) -> tuple[bytes, Mapping[str, str]]:
    """One request; the body and headers of a 2xx answer, else :class:`HTTPStatusError`. ``url`` is sent
    as encoded."""
    from yarl import URL

    async with session.request(
        method, URL(url, encoded=True), headers=headers, data=data, allow_redirects=allow_redirects
    ) as resp:
        body = await resp.read()
        if resp.status >= 300:
            raise HTTPStatusError.from_response(resp.status, resp.reason or "", resp.headers, body)
        return body, resp.headers


def request_blocking(
    method: str, url: str, headers: Mapping[str, str] | None, timeouts: Timeouts, verify_tls: bool | str
) -> tuple[bytes, Mapping[str, str]]:
    """:func:`request` on a connection of its own, with the standard library's client, in the calling thread
    (redirects are not followed): for a probe's one request (module doc). Its socket waits at most
    ``connect`` seconds for the handshake and ``read`` for each answer's bytes."""
    parts = urlsplit(url)
    conn: http.client.HTTPConnection
    if parts.scheme == "https":  # the sessions' TLS policy (``ssl_option``), as an ``SSLContext``
        option = ssl_option(verify_tls)
        context = option if isinstance(option, ssl.SSLContext) else ssl.create_default_context()
        if option is False:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        conn = http.client.HTTPSConnection(parts.hostname or "", parts.port, timeout=timeouts.connect, context=context)
    else:
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=timeouts.connect)
    try:
        conn.connect()
        if conn.sock is not None:
            conn.sock.settimeout(timeouts.read)
        conn.request(
            method, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), headers=dict(headers or {})
        )
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    if resp.status >= 300:  # (``resp.msg``: its headers, looked up regardless of case as aiohttp's are)
        raise HTTPStatusError.from_response(resp.status, resp.reason or "", resp.msg, body)
    return body, resp.msg


async def request_bytes(
    session: aiohttp.ClientSession, method: str, url: str, headers: Mapping[str, str] | None = None, **kw: Any
) -> bytes:
    """:func:`request`'s body only."""
    return (await request(session, method, url, headers, **kw))[0]
