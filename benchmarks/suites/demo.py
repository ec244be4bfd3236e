"""``make run``: why asyncload exists, in under a minute.

A synthetic segmentation dataset on a local S3 server (SeaweedFS) behind emulated WAN latency, read
twice in the first, cold, shuffled epoch a user meets: by the usual synchronous loop (``ds[i][col]``,
one round trip after another) and by ``AsyncLoader`` with its defaults, through a node block store of
its own, empty, removed after (``asyncload.tools.coldstore``): a second ``make run`` is cold too. The
emulation is packet-level (``testbeds/netem.py``: network namespaces, every packet delayed) where the
machine allows it, else a TCP proxy on loopback; the output says which. The server and the namespaces are gone when it ends.

    python benchmarks/suites/demo.py [--rtt-ms 40] [--rows 256]
    python -m asyncload demo          # the same comparison on a local dataset, no server
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a file: the checkout's packages first

from benchmarks.testbeds import netem  # noqa: E402


def _read(url: str, creds: dict[str, str], rows: int, sync_rows: int) -> dict[str, Any]:
    """In the client's namespace: the synchronous loop on ``sync_rows`` rows, then one asyncload epoch."""
    import deeplake
    import numpy as np

    from asyncload import AsyncLoader, DeepLakeSource
    from asyncload.tools.coldstore import cold_cache_dir

    order = np.random.default_rng(0).permutation(rows)[:sync_rows].tolist()
    ds = deeplake.open_read_only(url, creds=creds)
    t0 = time.perf_counter()
    for i in order:
        np.asarray(ds[i]["images"]), np.asarray(ds[i]["masks"])
    sync_s = time.perf_counter() - t0

    # asyncload's node block store, cold: a private, empty directory (a run of `make run` before this one
    # would otherwise have left the blocks on disk), removed after
    with cold_cache_dir() as store:
        t0 = time.perf_counter()
        loader = AsyncLoader(DeepLakeSource(url, creds=creds), batch_size=32, shuffle=True, seed=0, cache_dir=store)
        n = sum(len(b["index"]) for b in loader)
        async_s = time.perf_counter() - t0  # opening the dataset included: what a user waits for
        loader.close()
    stats = loader.stats()
    return {
        "sync": sync_rows / sync_s,
        "asyncload": n / async_s,
        "rows": n,
        "concurrency": stats["concurrency"],
        "remote_mb": stats["remote_bytes"] / 1e6,
        "node_hits": stats["node_hits"],
    }


def _write(url: str, creds: dict[str, str], rows: int) -> str:
    from asyncload import make_dataset

    return make_dataset(url, rows, creds=creds, progress=False, overwrite=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rtt-ms", type=float, default=40.0, help="emulated round-trip time (default 40 ms)")
    ap.add_argument("--rows", type=int, default=256, help="rows of 256x256 images + masks (default 256)")
    ap.add_argument("--sync-rows", type=int, default=48, help="rows the synchronous loop reads (default 48)")
    ap.add_argument("--proxy", action="store_true", help="use the TCP proxy even where packet-level works")
    args = ap.parse_args(argv)
    from harness.seaweed import SeaweedServer

    t0 = time.perf_counter()
    with netem.network(ROOT / "data" / "netem", force_proxy=args.proxy) as net:
        net.enter_server()  # set up and upload from the server's side, without delay
        with SeaweedServer(host=net.server_host) as server:
            bucket = server.create_bucket("demo")
            url = f"s3://{bucket}/seg"
            # Written from a child forked inside the server's namespace: Deep Lake's storage threads are
            # made at fork time, so a thread that only switched namespace would leave them behind.
            netem.fork_call(net.enter_server, _write, url, server.creds(), args.rows, timeout=300)
            net.set_rtt(args.rtt_ms / 1e3)
            creds = {**server.creds(), "endpoint_url": net.url(server.port)}
            got = netem.fork_call(net.enter_client, _read, url, creds, args.rows, args.sync_rows, timeout=300)
            emulation = net.describe()["emulation"]
    ratio = got["asyncload"] / got["sync"]
    print(
        f"\n{args.rows} rows of 256x256 PNG images + masks on SeaweedFS at {args.rtt_ms:g} ms RTT ({emulation}), "
        f"first epoch, cold, shuffled:\n\n"
        f"| reader | samples/s | x synchronous |\n|---|---|---|\n"
        f"| synchronous ds[i][col] ({args.sync_rows} rows) | {got['sync']:.1f} | 1.0 |\n"
        f"| asyncload, defaults (whole epoch, open included) | {got['asyncload']:.1f} | {ratio:.1f} |\n\n"
        f"Cold: asyncload read through a private, empty node store (removed after): {got['remote_mb']:.1f} MB "
        f"of rows fetched from the server, {got['node_hits']} rows from local disk.\n"
        f"asyncload kept up to {got['concurrency']} samples in flight; done in {time.perf_counter() - t0:.0f} s "
        f"(server and network torn down). Machine: {os.cpu_count()} cores.",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
