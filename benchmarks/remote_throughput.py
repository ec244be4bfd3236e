"""Samples/s from a real S3 server (SeaweedFS on loopback, no added latency) for both remote sources.

What it compares:

- **Deep Lake on ``s3://``**: ``asyncload.measure.sequential`` (``ds[i][col]`` one after another) against
  ``AsyncLoader(DeepLakeSource(...))`` at concurrency 16/64/256, column and row reads, with Deep Lake's
  storage thread pool left at its default (``storage_concurrency=None``: 16 threads) and raised
  (``"auto"``: requests in flight × columns, so in column mode, with few large requests, it often stays
  at 16; the row label shows the pool size each run had). The pool is process-wide and only grows, so
  every ``None`` row runs before the first ``"auto"`` row.
- **Object store** (``images/<stem>.png`` + ``masks/<stem>.png``): a sequential loop of signed GETs on
  one keep-alive connection, decoding each object (the same decoder), against
  ``AsyncLoader(ObjectStoreSource(...))`` at the same concurrencies, in ``column`` and ``row`` mode.
- ``--signers``: raw signed GETs of the image objects at 64 in flight, three ways: aiohttp + asyncload's
  signer, aiohttp + botocore's ``S3SigV4Auth``, aiobotocore's ``get_object``; GETs/s and CPU µs per GET
  (the client process only). Needs botocore / aiobotocore importable (they are not dependencies).

Run: ``.venv/bin/python benchmarks/remote_throughput.py [--rows 512] [--size 256] [--signers] [--rtt-ms 20]``.
Loopback has no latency, so these figures show client CPU cost per sample, on a 2-core machine shared
with the server: the server's own CPU use is part of every figure. ``--rtt-ms`` puts
``harness.delayline.DelayLine`` in front of the endpoint to see latency hiding instead.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import io
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from asyncload import AsyncLoader, DeepLakeSource, ObjectStoreSource, make_dataset
from asyncload.measure import Measurement, measure, sequential, table
from asyncload.sources.imagecodec import decode_image
from asyncload.sources.s3 import S3Endpoint
from asyncload.synthetic import make_sample
from harness.seaweed import SeaweedServer

BUCKET = "bench"


def png(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def upload(server: SeaweedServer, rows: int, size: int) -> None:
    def one(i: int) -> None:
        img, mask = make_sample(np.random.default_rng([0, i]), size, size)
        server.put_object(BUCKET, f"files/images/{i:06d}.png", png(img))
        server.put_object(BUCKET, f"files/masks/{i:06d}.png", png(mask))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(rows)))


def sequential_gets(creds: dict[str, str], rows: int) -> Iterator[int]:
    """The object-store baseline: one signed GET after another on one keep-alive connection, decoded."""
    s3 = S3Endpoint.resolve(creds)
    host, _, port = s3.endpoint_url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        for i in range(rows):
            for col, mode in (("images", "rgb"), ("masks", "gray")):
                url = s3.url(BUCKET, f"files/{col}/{i:06d}.png")
                path = url[len(s3.endpoint_url) :]
                conn.request("GET", path, headers=s3.headers("GET", url))
                resp = conn.getresponse()
                body = resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"GET {path}: HTTP {resp.status}")
                np.array(decode_image(body, mode, path))  # type: ignore[arg-type]
            yield 1
    finally:
        conn.close()


def one(x: object) -> int:
    return 1


def run_loader(name: str, src: object, concurrency: int, read_mode: str, batch_size: int) -> Measurement:
    loader = AsyncLoader(src, batch_size=batch_size, concurrency=concurrency, read_mode=read_mode)  # type: ignore[arg-type]
    return measure(name, loader)


# -- signer comparison -------------------------------------------------------------------------------


async def _signed_gets_ours(server: SeaweedServer, keys: list[str], inflight: int) -> None:
    import aiohttp
    from yarl import URL

    s3 = S3Endpoint.resolve(server.creds())
    sem = asyncio.Semaphore(inflight)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=inflight)) as session:

        async def get(key: str) -> None:
            async with sem:
                url = s3.url(BUCKET, key)
                async with session.get(URL(url, encoded=True), headers=s3.headers("GET", url)) as r:
                    await r.read()
                    assert r.status == 200

        await asyncio.gather(*(get(k) for k in keys))


async def _signed_gets_botocore(server: SeaweedServer, keys: list[str], inflight: int) -> None:
    import aiohttp
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials
    from yarl import URL

    creds = Credentials(server.access_key, server.secret_key)
    s3 = S3Endpoint.resolve(server.creds())  # for the URL only
    sem = asyncio.Semaphore(inflight)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=inflight)) as session:

        async def get(key: str) -> None:
            async with sem:
                url = s3.url(BUCKET, key)
                req = AWSRequest(method="GET", url=url, headers={"x-amz-content-sha256": "UNSIGNED-PAYLOAD"})
                S3SigV4Auth(creds, "s3", server.region).add_auth(req)
                async with session.get(URL(url, encoded=True), headers=dict(req.headers.items())) as r:
                    await r.read()
                    assert r.status == 200

        await asyncio.gather(*(get(k) for k in keys))


async def _signed_gets_aiobotocore(server: SeaweedServer, keys: list[str], inflight: int) -> None:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    cfg = AioConfig(max_pool_connections=inflight, retries={"max_attempts": 1}, s3={"addressing_style": "path"})
    async with get_session().create_client(
        "s3", endpoint_url=server.endpoint_url, region_name=server.region,
        aws_access_key_id=server.access_key, aws_secret_access_key=server.secret_key, config=cfg,
    ) as client:  # fmt: skip
        sem = asyncio.Semaphore(inflight)

        async def get(key: str) -> None:
            async with sem:
                resp = await client.get_object(Bucket=BUCKET, Key=key)
                async with resp["Body"] as body:
                    await body.read()

        await asyncio.gather(*(get(k) for k in keys))


def signer_table(server: SeaweedServer, rows: int, inflight: int = 64, repeat: int = 4) -> str:
    keys = [f"files/images/{i:06d}.png" for i in range(rows)] * repeat
    lines = ["| client | GETs | GETs/s | client CPU µs/GET | import s |", "|---|---|---|---|---|"]
    for name, fn, mod in (
        ("aiohttp + asyncload.sigv4", _signed_gets_ours, "asyncload.sigv4"),
        ("aiohttp + botocore S3SigV4Auth", _signed_gets_botocore, "botocore.auth"),
        ("aiobotocore get_object", _signed_gets_aiobotocore, "aiobotocore.session"),
    ):
        t = time.perf_counter()
        try:
            __import__(mod)
        except ImportError as exc:
            lines.append(f"| {name} | - | not installed ({exc.name}) | - | - |")
            continue
        imp = time.perf_counter() - t
        asyncio.run(fn(server, keys[:inflight], inflight))  # warm-up: connections, imports
        t0, c0 = time.perf_counter(), time.process_time()
        asyncio.run(fn(server, keys, inflight))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        lines.append(f"| {name} | {len(keys)} | {len(keys) / wall:,.0f} | {1e6 * cpu / len(keys):,.0f} | {imp:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--size", type=int, default=256, help="image side in pixels")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--signers", action="store_true", help="also compare SigV4 clients on raw GETs")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="add this round-trip time with a DelayLine (default 0)")
    args = p.parse_args()

    with SeaweedServer() as server:
        server.create_bucket(BUCKET)
        creds = server.creds()
        t = time.perf_counter()
        url = make_dataset(
            f"s3://{BUCKET}/seg", args.rows, height=args.size, width=args.size, creds=creds, progress=False
        )
        upload(server, args.rows, args.size)
        print(f"# {args.rows} rows of {args.size}x{args.size} PNG + mask, written in {time.perf_counter() - t:.1f}s; "
              f"SeaweedFS at {server.endpoint_url}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")  # fmt: skip

        delay = None
        if args.rtt_ms > 0:
            from harness.delayline import DelayLine

            delay = DelayLine((server.host, server.port), rtt_s=args.rtt_ms / 1e3).__enter__()
            creds = dict(creds, endpoint_url=delay.url)
            print(f"# reads go through a DelayLine adding {args.rtt_ms:g} ms of round-trip time")
        try:
            deeplake_table(url, creds, args)
            objectstore_table(server, creds, args)
        finally:
            if delay is not None:
                delay.__exit__(None, None, None)

        if args.signers:
            print("\n## SigV4 clients: raw GETs of the image objects, 64 in flight\n")
            print(signer_table(server, args.rows))
    return 0


def deeplake_table(url: str, creds: dict[str, str], args: argparse.Namespace) -> None:
    import deeplake

    print(f"\n## Deep Lake on s3:// (storage threads at start: {deeplake.storage.concurrency()})\n")
    measure("warm-up", sequential(url, ("images", "masks"), limit=32, creds=creds), count=one)
    base = measure("sequential ds[i][col]", sequential(url, ("images", "masks"), creds=creds), count=one)
    rows = [base]
    for setting in (None, "auto"):  # the pool only grows: every None row first
        for mode in ("column", "row"):
            for c in args.concurrency:
                src = DeepLakeSource(url, creds=creds, storage_concurrency=setting)
                m = run_loader(
                    f"AsyncLoader c={c}, {mode}, storage_concurrency={setting!r}", src, c, mode, args.batch_size
                )
                m.name += f" (threads {deeplake.storage.concurrency()})"
                rows.append(m)
    print(table(rows, base))


def objectstore_table(server: SeaweedServer, creds: dict[str, str], args: argparse.Namespace) -> None:
    print("\n## Object store: s3://bench/files/{images,masks}/<stem>.png\n")
    files = f"s3://{BUCKET}/files"
    base = measure("sequential signed GET + decode", sequential_gets(creds, args.rows), count=one)
    rows = [base]
    for mode in ("column", "row"):
        for c in args.concurrency:
            src = ObjectStoreSource(files, creds=creds)
            m = run_loader(f"AsyncLoader c={c}, {mode}", src, c, mode, args.batch_size)
            stats = src.retry_stats()
            m.name += f" (pool {src.connections()}, retries {stats['retries']})"
            rows.append(m)
    print(table(rows, base))


if __name__ == "__main__":
    sys.exit(main())
