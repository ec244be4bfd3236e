"""Samples/s against worker processes 1…N: asyncload (``processes=K``; ``processes=0`` as the one-process
point), asyncload's torch adapter (``AsyncIterableDataset`` in ``DataLoader(num_workers=K,
persistent_workers=True)``) and a synchronous map-style Dataset in the same DataLoader, in one run, on a
Deep Lake dataset of 256×256 PNG images + lz4 masks: on local disk, and with ``--rtt-ms`` also on an S3
store behind that round-trip time.

    python benchmarks/suites/scaling.py --small --rtt-ms 50    # 2 cores: local, then at 50 ms (~5 min)
    python benchmarks/suites/scaling.py --rtt-ms 50            # N = os.cpu_count(): K = 1…N, 3,000 rows

Each configuration runs two epochs on one loader (``set_epoch`` 0, then 1; shuffled, batch 32) and
reports, per epoch: samples/s over the whole epoch (from ``iter()`` to the last batch, so epoch 1 pays the
workers' start-up), samples/s after the first batch, and the time to the first batch. Epoch 2 is what a
training run sees from then on: persistent workers must make its first batch come at once (the script
checks that asyncload's worker pids did not change). The consumer only counts the batches; every epoch
must deliver each row exactly once (checked), so no configuration can win by dropping samples.

``--rtt-ms``: the same dataset's files on SeaweedFS in the server namespace of ``netem.network()``
(packet-level NFQUEUE delay as root, else the TCP proxy; the tables name which, with a measured small-GET
round trip). Each configuration runs in a fresh process started inside the client namespace, so it, its
workers and Deep Lake's threads all read over the emulated path, and its first epoch is cold: Deep Lake's
caches are new, and asyncload's node block store is a private, empty directory, removed after
(``asyncload.tools.coldstore``), so epoch 2 of an asyncload row reads what its epoch 1 fetched, never what
an earlier configuration did.

Writes ``results.json``, ``table.md`` and ``scaling.png`` under
``benchmarks/results/scaling/<machine>/`` (``<machine>``: cores and GPU, or ``--name``). Needs only torch,
deeplake, asyncload and matplotlib (and, for ``--rtt-ms``, SeaweedFS's ``weed``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing as mp
import os
import platform
import re
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks, harness; and this checkout's asyncload before any installed one

import deeplake  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource, make_dataset  # noqa: E402
from asyncload.tools.train.data import SyncSegmentation  # noqa: E402

LOCAL = "local disk"


@dataclass
class Epoch:
    samples: int
    seconds: float
    first_batch_s: float
    first_batch_samples: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def after_first_per_s(self) -> float:
        return (self.samples - self.first_batch_samples) / max(self.seconds - self.first_batch_s, 1e-9)


@dataclass
class Row:
    system: str  # "asyncload", "adapter" (AsyncIterableDataset in DataLoader workers) or "DataLoader"
    workers: int  # worker processes (asyncload processes=0 counts as 1, in-process)
    label: str
    epochs: list[Epoch]
    same_workers: bool | None  # asyncload: the same pids in both epochs
    store: str = LOCAL  # or "S3 at <rtt> ms RTT"
    load: float = 0.0  # 1-minute load average when the configuration finished


def store_name(rtt_ms: float | None) -> str:
    return LOCAL if rtt_ms is None else f"S3 at {rtt_ms:g} ms RTT"


def run_epoch(batches: Iterable[Any], rows: int) -> Epoch:
    """Consume one epoch; check that every row came exactly once."""
    t0 = time.perf_counter()
    first, first_samples = None, 0
    seen: list[int] = []
    for b in batches:
        if first is None:
            first, first_samples = time.perf_counter() - t0, len(b["index"])
        seen.extend(b["index"].tolist())
    seconds = time.perf_counter() - t0
    assert sorted(seen) == list(range(rows)), f"an epoch delivered {len(seen)} samples, not each of {rows} once"
    return Epoch(len(seen), seconds, first or 0.0, first_samples)


def run_asyncload(url: str, creds: dict[str, str] | None, rows: int, processes: int, batch: int, epochs: int) -> Row:
    loader = AsyncLoader(
        DeepLakeSource(url, creds=creds), batch_size=batch, shuffle=True, seed=0, processes=processes
    )  # fmt: skip
    out, pids = [], []
    with loader:
        for e in range(epochs):
            loader.set_epoch(e)
            it = iter(loader)
            out.append(run_epoch(it, rows))
            pids.append(getattr(it, "pids", {}))
    label = f"asyncload processes={processes}" + (" (in-process)" if processes == 0 else "")
    same = all(p == pids[0] for p in pids) and bool(pids[0]) if processes else None
    return Row("asyncload", max(processes, 1), label, out, same)


def run_adapter(url: str, creds: dict[str, str] | None, rows: int, workers: int, batch: int, epochs: int) -> Row:
    """asyncload's torch adapter: ``AsyncIterableDataset`` in persistent DataLoader workers, each its own reader."""
    ds = AsyncIterableDataset(DeepLakeSource(url, creds=creds), batch, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True, multiprocessing_context="spawn")
    out = []
    for e in range(epochs):
        ds.set_epoch(e)
        out.append(run_epoch(dl, rows))
    del dl
    label = f"AsyncIterableDataset in DataLoader num_workers={workers}, persistent"
    return Row("adapter", workers, label, out, None)


def run_dataloader(url: str, creds: dict[str, str] | None, rows: int, workers: int, batch: int, epochs: int) -> Row:
    """The synchronous baseline (``asyncload.tools.train``'s): one blocking read per column and row, in the workers."""
    dl = DataLoader(
        SyncSegmentation(url, 0, rows, creds), batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=True,
        multiprocessing_context="spawn", generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    out = [run_epoch(dl, rows) for _ in range(epochs)]
    del dl  # persistent workers stop when the DataLoader's iterator is collected
    return Row("DataLoader", workers, f"DataLoader num_workers={workers}, persistent", out, None)


def machine() -> dict[str, Any]:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cores": os.cpu_count(), "gpu": gpu, "platform": platform.platform(), "python": platform.python_version(),
        "torch": torch.__version__, "deeplake": deeplake.__version__, "load_average_start": os.getloadavg()[0],
    }  # fmt: skip


def machine_name(info: dict[str, Any]) -> str:
    gpu = re.sub(r"[^a-z0-9]+", "-", (info["gpu"] or "").lower().replace("nvidia", "")).strip("-")
    return f"{info['cores']}-cores" + (f"-{gpu}" if gpu else "-cpu")


def ratios(rows: list[Row], r: Row) -> tuple[str, str]:
    """Epoch 2 samples/s against asyncload in-process, and (asyncload rows) epochs 1 / 2 against DataLoader
    with as many workers, both on the same store."""
    same = [x for x in rows if x.store == r.store]
    inproc = next((x for x in same if x.system == "asyncload" and "in-process" in x.label), None)
    dl = next((x for x in same if x.system == "DataLoader" and x.workers == r.workers), None)
    vs_inproc = f"{r.epochs[-1].samples_per_s / inproc.epochs[-1].samples_per_s:.2f}" if inproc else ""
    vs_dl = ""
    if dl is not None and r.system != "DataLoader" and "in-process" not in r.label:
        vs_dl = " / ".join(f"{a.samples_per_s / b.samples_per_s:.2f}" for a, b in zip(r.epochs, dl.epochs, strict=True))
    return vs_inproc, vs_dl


def table(rows: list[Row], info: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "# Scaling with worker processes",
        "",
        f"{info['cores']} cores, GPU: {info['gpu'] or 'none'}; {info['platform']}, Python {info['python']}, "
        f"torch {info['torch']}, deeplake {info['deeplake']}; load average {info['load_average_start']:.2f} at "
        f"the start, {info.get('load_average_end', 0):.2f} at the end (a shared machine). {args.rows} rows of "
        f"256×256 PNG images + lz4 masks, batch {args.batch_size}, shuffled; one run each. samples/s over the "
        f"whole epoch (epoch 1 includes start-up); × in-process: epoch 2 against asyncload with one process "
        f"in-process; × DataLoader: an asyncload row against the synchronous Dataset in a DataLoader with as "
        f"many persistent workers, epoch 1 / 2.",
    ]
    if net := info.get("network"):
        path = net.get("path", {})
        lines += [
            "",
            f"At {args.rtt_ms:g} ms: {net['emulation']} ({net['how']}); SeaweedFS S3 in the server namespace; "
            f"each configuration a fresh process started in the client namespace (its first epoch cold: new Deep "
            f"Lake caches, and asyncload's node block store a private, empty directory, removed after). "
            f"Measured path: small GET {1e3 * path.get('small_get_s', 0):.1f} ms, TCP connect "
            f"{1e3 * path.get('connect_s', 0):.1f} ms, one 8 MB GET {path.get('large_mb_s', 0):.0f} MB/s. "
            f"Deep Lake keeps the blocks a process has read: the dataset ({info.get('dataset_mb', 0):.0f} MB) fits, "
            f"so epoch 2 reads from each process's cache and epoch 1 is the figure for the network.",
        ]
    for store in dict.fromkeys(r.store for r in rows):
        lines += [
            "",
            f"## {store}",
            "",
            "| loader | workers | epoch 1 samples/s | epoch 1 after first batch | epoch 1 first batch s | epoch 2 "
            "samples/s | epoch 2 after first batch | epoch 2 first batch s | × in-process | × DataLoader | same workers |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r.store == store):
            e1, e2 = r.epochs[0], r.epochs[-1]
            same = {None: "", True: "yes", False: "NO"}[r.same_workers]
            vs_inproc, vs_dl = ratios(rows, r)
            lines.append(
                f"| {r.label} | {r.workers} | {e1.samples_per_s:,.0f} | {e1.after_first_per_s:,.0f} | {e1.first_batch_s:.2f} | "
                f"{e2.samples_per_s:,.0f} | {e2.after_first_per_s:,.0f} | {e2.first_batch_s:.3f} | {vs_inproc} | "
                f"{vs_dl} | {same} |"
            )
    lines += ["", f"Command: `{info['command']}`", ""]
    return "\n".join(lines)


def plot(rows: list[Row], info: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stores = list(dict.fromkeys(r.store for r in rows))
    fig, axes = plt.subplots(len(stores), 2, figsize=(11, 4.2 * len(stores)), squeeze=False)
    for store, (ax, ax2) in zip(stores, axes, strict=True):
        here = [r for r in rows if r.store == store]
        series = {
            "asyncload processes=K": [r for r in here if r.system == "asyncload" and "in-process" not in r.label],
            "asyncload in-process": [r for r in here if "in-process" in r.label],
            "AsyncIterableDataset in DataLoader workers": [r for r in here if r.system == "adapter"],
            "DataLoader persistent workers": [r for r in here if r.system == "DataLoader"],
        }
        for (name, rs), marker in zip(series.items(), "os^D", strict=True):
            if not rs:
                continue
            ks = [r.workers for r in rs]
            for e, style in ((-1, "-"), (0, ":")):
                label = f"{name}, epoch {'2' if e else '1'}"
                alpha = 1.0 if e else 0.6
                ax.plot(ks, [r.epochs[e].samples_per_s for r in rs], marker=marker, ls=style, alpha=alpha, label=label)
                ax2.plot(ks, [r.epochs[e].first_batch_s for r in rs], marker=marker, ls=style, alpha=alpha, label=label)
        one = [r for r in series["asyncload processes=K"] if r.workers == 1]
        if one:
            kmax, rate = max(r.workers for r in here), one[0].epochs[-1].samples_per_s
            ax.plot([1, kmax], [rate, kmax * rate], "k--", lw=0.8, label="linear from processes=1")
        ax.set(xlabel="worker processes", ylabel="samples/s (whole epoch)", title=f"throughput, {store}")
        ax2.set(xlabel="worker processes", ylabel="seconds", title=f"time to first batch, {store}", yscale="log")
        for a in (ax, ax2):
            a.set_xticks(sorted({r.workers for r in here}))
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
    emulation = f"; {info['network']['emulation']}" if info.get("network") else ""
    fig.suptitle(f"{info['cores']} cores, GPU {info['gpu'] or 'none'}: 256×256 PNG + mask, Deep Lake{emulation}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def measure(system: str, k: int, url: str, creds: dict[str, str] | None, args: argparse.Namespace) -> Row:
    run = {"asyncload": run_asyncload, "adapter": run_adapter, "DataLoader": run_dataloader}[system]
    return run(url, creds, args.rows, k, args.batch_size, args.epochs)


def _reply(conn: Any, fn: Any, args: tuple[Any, ...]) -> None:
    """In the fresh process: ``fn(*args)`` (or its error) back to the parent, then exit hard (Deep Lake's
    threads can crash a normal interpreter exit; the loaders were closed and the result is out). asyncload
    reads through a node block store of this configuration's own, empty, removed after: its epoch 1 is
    cold (a store shared with the configurations before would serve it from local disk)."""
    from asyncload.tools.coldstore import cold_cache_dir

    with cold_cache_dir(env=True):  # the workers it starts inherit $ASYNCLOAD_CACHE_DIR: one store per node
        try:
            out: Any = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = RuntimeError(f"{type(exc).__name__}: {exc}")
    conn.send(out)
    conn.close()
    os._exit(0)


def in_client(net: Any, fn: Any, *args: Any, timeout_s: float = 3600.0) -> Any:
    """``fn(*args)`` in a fresh spawned process started from inside the client's network namespace
    (``netem.inside``): it, the worker processes it starts and Deep Lake's threads all read over the
    emulated path, and its Deep Lake caches start cold."""
    from benchmarks.testbeds import netem

    ctx = mp.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_reply, args=(send, fn, args))
    with netem.inside(net.enter_client):
        p.start()
    send.close()
    try:
        out = recv.recv() if recv.poll(timeout_s) else TimeoutError(f"no result within {timeout_s:.0f}s")
    except EOFError:
        out = RuntimeError("the process died without a result")
    p.join(10)
    if p.is_alive():
        p.kill()
        p.join()
    if isinstance(out, BaseException):
        raise out
    return out


def over_network(
    args: argparse.Namespace, local: Path, steps: list[tuple[str, int]], info: dict[str, Any]
) -> Iterator[Row]:
    """The same configurations on the dataset's files served by SeaweedFS behind ``args.rtt_ms``."""
    from benchmarks.testbeds import netem
    from harness.seaweed import SeaweedServer

    with netem.network(ROOT / "data" / "netem") as net:
        net.enter_server()  # set-up and upload from the server's side: no delay
        with SeaweedServer(host=net.server_host) as server:
            bucket = server.create_bucket("scaling")
            server.put_tree(bucket, "scaling", local)  # the same bytes
            netem.put_check_objects(server, bucket)
            rtt_s = args.rtt_ms / 1e3
            net.set_rtt(rtt_s)
            filer = net.url(int(server.filer_url.rsplit(":", 1)[1]))
            info["network"] = {**net.describe(), "path": in_client(net, netem.check_path, filer, bucket, rtt_s)}
            print(f"network: {info['network']['emulation']}, small GET "
                  f"{1e3 * info['network']['path']['small_get_s']:.1f} ms", flush=True)  # fmt: skip
            creds = {**server.creds(), "endpoint_url": net.url(server.port)}
            for system, k in steps:
                row = in_client(net, measure, system, k, f"s3://{bucket}/scaling", creds, args)
                row.store = store_name(args.rtt_ms)
                yield row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the 2-core form: 1,000 rows")
    ap.add_argument("--rows", type=int, default=None, help="default 3000 (1000 with --small)")
    ap.add_argument("--processes", type=int, nargs="+", default=None, help="worker counts (default 1…cores)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    systems = ["asyncload", "adapter", "DataLoader"]
    ap.add_argument(
        "--systems",
        nargs="+",
        default=systems,
        choices=systems,
        help="adapter: AsyncIterableDataset in DataLoader workers",
    )
    ap.add_argument("--rtt-ms", type=float, default=None, help="also on an S3 store at this round-trip time")
    ap.add_argument("--data", default=None, help="dataset directory (made once; default /tmp/asyncload-scaling-<rows>)")
    ap.add_argument("--name", default=None, help="results folder name (default: cores and GPU)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scaling"))
    args = ap.parse_args()
    args.rows = args.rows or (1000 if args.small else 3000)
    ks = args.processes or list(range(1, (os.cpu_count() or 1) + 1))

    info = machine()
    info["command"] = " ".join(["python", *sys.argv])
    print(f"machine: {info['cores']} cores, GPU: {info['gpu'] or 'none'}, {info['platform']}", flush=True)
    path = Path(args.data or f"/tmp/asyncload-scaling-{args.rows}").resolve()
    url = "file://" + str(path)
    if not deeplake.exists(url) or len(deeplake.open_read_only(url)) != args.rows:
        t0 = time.perf_counter()
        make_dataset(url, args.rows, overwrite=True, progress=False)
        print(f"made {args.rows} rows of 256x256 PNG + masks at {path} in {time.perf_counter() - t0:.0f}s", flush=True)

    info["dataset_mb"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6
    out = Path(args.out) / (args.name or machine_name(info))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    steps = [("asyncload", 0)] + [(s, k) for k in ks for s in args.systems]
    local = (measure(system, k, url, None, args) for system, k in steps)
    remote = over_network(args, path, steps, info) if args.rtt_ms is not None else iter(())
    for r in itertools.chain(local, remote):
        rows.append(r)
        r.load = os.getloadavg()[0]
        e1, e2 = r.epochs[0], r.epochs[-1]
        print(
            f"{r.store:16s} {r.label:66s} epoch 1 {e1.samples_per_s:7,.0f}/s (first batch {e1.first_batch_s:5.2f}s)  "
            f"epoch 2 {e2.samples_per_s:7,.0f}/s (first batch {e2.first_batch_s:6.3f}s)  load {r.load:.1f}",
            flush=True,
        )  # fmt: skip
        write(out, rows, info, args)  # after every step: a run cut short keeps what it measured
    plot(rows, info, out / "scaling.png")
    print(f"\n{table(rows, info, args)}\nwritten to {out}")
    return 0


def write(out: Path, rows: list[Row], info: dict[str, Any], args: argparse.Namespace) -> None:
    info["load_average_end"] = os.getloadavg()[0]
    result = {
        "machine": info, "rows": args.rows, "batch_size": args.batch_size, "epochs": args.epochs,
        "rtt_ms": args.rtt_ms, "command": info["command"],
        "runs": [asdict(r) | {"per_epoch": [
            {"samples_per_s": e.samples_per_s, "after_first_per_s": e.after_first_per_s} for e in r.epochs
        ]} for r in rows],
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(table(rows, info, args))


if __name__ == "__main__":
    sys.exit(main())
