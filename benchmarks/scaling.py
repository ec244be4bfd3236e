"""Samples/s against worker processes 1…N: asyncload (``processes=K``; ``processes=0`` as the one-process
point) and a synchronous map-style Dataset in ``DataLoader(num_workers=K, persistent_workers=True)``, in
one run, on a local Deep Lake dataset of 256×256 PNG images + lz4 masks.

    python benchmarks/scaling.py --small        # 2 cores: a few minutes
    python benchmarks/scaling.py                # N = os.cpu_count(): K = 1…N, 3,000 rows

Each configuration runs two epochs on one loader (``set_epoch`` 0, then 1; shuffled, batch 32) and
reports, per epoch: samples/s over the whole epoch (from ``iter()`` to the last batch, so epoch 1 pays the
workers' start-up), samples/s after the first batch, and the time to the first batch. Epoch 2 is what a
training run sees from then on: persistent workers must make its first batch come at once (the script
checks that asyncload's worker pids did not change). The consumer only counts the batches; every epoch
must deliver each row exactly once (checked), so no configuration can win by dropping samples.

Writes ``results.json``, ``table.md`` and ``scaling.png`` under
``benchmarks/results/scaling/<machine>/`` (``<machine>``: cores and GPU, or ``--name``). Needs only torch,
deeplake, asyncload and matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import deeplake
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from asyncload import AsyncLoader, DeepLakeSource, make_dataset

HERE = Path(__file__).resolve().parent


class DeepLakeMapDataset(Dataset):  # type: ignore[type-arg]
    """The synchronous baseline: one blocking read per column and row, decoded in the worker process.
    The handle opens lazily in the worker that uses it (a dataset handle must not cross a fork)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.n = len(deeplake.open_read_only(url))
        self._ds: Any = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if self._ds is None:
            self._ds = deeplake.open_read_only(self.url)
        row = self._ds[int(i)]
        return {
            "images": torch.from_numpy(np.array(row["images"])),
            "masks": torch.from_numpy(np.array(row["masks"])),
            "index": int(i),
        }

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ds": None}


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
    system: str  # "asyncload" or "DataLoader"
    workers: int  # worker processes (asyncload processes=0 counts as 1, in-process)
    label: str
    epochs: list[Epoch]
    same_workers: bool | None  # asyncload: the same pids in both epochs


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


def run_asyncload(url: str, rows: int, processes: int, batch: int, epochs: int) -> Row:
    loader = AsyncLoader(DeepLakeSource(url), batch_size=batch, shuffle=True, seed=0, processes=processes)
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


def run_dataloader(url: str, rows: int, workers: int, batch: int, epochs: int) -> Row:
    dl = DataLoader(
        DeepLakeMapDataset(url), batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=True,
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


def table(rows: list[Row], info: dict[str, Any], args: argparse.Namespace) -> str:
    base = next((r for r in rows if r.system == "asyncload" and r.workers == 1), rows[0]).epochs[-1].samples_per_s
    lines = [
        "# Scaling with worker processes",
        "",
        f"{info['cores']} cores, GPU: {info['gpu'] or 'none'}; {info['platform']}, Python {info['python']}, "
        f"torch {info['torch']}, deeplake {info['deeplake']}; load average {info['load_average_start']:.2f} at "
        f"the start. {args.rows} rows of 256×256 PNG images + lz4 masks on local disk, batch {args.batch_size}, "
        f"shuffled; one run each. samples/s over the whole epoch (epoch 1 includes start-up); "
        f"× is epoch 2 against asyncload with one process in-process.",
        "",
        "| loader | workers | epoch 1 samples/s | epoch 1 first batch s | epoch 2 samples/s | epoch 2 after first batch | "
        "epoch 2 first batch s | × | same workers |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        e1, e2 = r.epochs[0], r.epochs[-1]
        same = {None: "", True: "yes", False: "NO"}[r.same_workers]
        lines.append(
            f"| {r.label} | {r.workers} | {e1.samples_per_s:,.0f} | {e1.first_batch_s:.2f} | {e2.samples_per_s:,.0f} | "
            f"{e2.after_first_per_s:,.0f} | {e2.first_batch_s:.3f} | {e2.samples_per_s / base:.2f} | {same} |"
        )
    lines += ["", f"Command: `{' '.join(['python', *sys.argv])}`", ""]
    return "\n".join(lines)


def plot(rows: list[Row], info: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = {
        "asyncload processes=K": [r for r in rows if r.system == "asyncload" and "in-process" not in r.label],
        "asyncload in-process": [r for r in rows if "in-process" in r.label],
        "DataLoader persistent workers": [r for r in rows if r.system == "DataLoader"],
    }
    for (name, rs), marker in zip(series.items(), "osD", strict=True):
        if not rs:
            continue
        ks = [r.workers for r in rs]
        ax.plot(ks, [r.epochs[-1].samples_per_s for r in rs], marker=marker, label=f"{name}, epoch 2")
        ax.plot(ks, [r.epochs[0].samples_per_s for r in rs], marker=marker, ls=":", alpha=0.6, label=f"{name}, epoch 1")
        ax2.plot(ks, [r.epochs[-1].first_batch_s for r in rs], marker=marker, label=f"{name}, epoch 2")
        ax2.plot(
            ks, [r.epochs[0].first_batch_s for r in rs], marker=marker, ls=":", alpha=0.6, label=f"{name}, epoch 1"
        )
    one = [r for r in series["asyncload processes=K"] if r.workers == 1]
    if one:
        kmax = max(r.workers for r in rows)
        ax.plot(
            [1, kmax],
            [one[0].epochs[-1].samples_per_s, kmax * one[0].epochs[-1].samples_per_s],
            "k--",
            lw=0.8,
            label="linear from processes=1",
        )
    ax.set(xlabel="worker processes", ylabel="samples/s (whole epoch)", title="throughput")
    ax2.set(xlabel="worker processes", ylabel="seconds", title="time to first batch", yscale="log")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"{info['cores']} cores, GPU {info['gpu'] or 'none'}: 256×256 PNG + mask, local Deep Lake")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="the 2-core form: 1,000 rows")
    ap.add_argument("--rows", type=int, default=None, help="default 3000 (1000 with --small)")
    ap.add_argument("--processes", type=int, nargs="+", default=None, help="worker counts (default 1…cores)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--systems", nargs="+", default=["asyncload", "DataLoader"], choices=["asyncload", "DataLoader"])
    ap.add_argument("--data", default=None, help="dataset directory (made once; default /tmp/asyncload-scaling-<rows>)")
    ap.add_argument("--name", default=None, help="results folder name (default: cores and GPU)")
    ap.add_argument("--out", default=str(HERE / "results" / "scaling"))
    args = ap.parse_args()
    args.rows = args.rows or (1000 if args.small else 3000)
    ks = args.processes or list(range(1, (os.cpu_count() or 1) + 1))

    info = machine()
    print(f"machine: {info['cores']} cores, GPU: {info['gpu'] or 'none'}, {info['platform']}", flush=True)
    path = Path(args.data or f"/tmp/asyncload-scaling-{args.rows}")
    url = "file://" + str(path.resolve())
    if not deeplake.exists(url) or len(deeplake.open_read_only(url)) != args.rows:
        t0 = time.perf_counter()
        make_dataset(url, args.rows, overwrite=True, progress=False)
        print(f"made {args.rows} rows of 256x256 PNG + masks at {path} in {time.perf_counter() - t0:.0f}s", flush=True)

    out = Path(args.out) / (args.name or machine_name(info))
    out.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    steps = [("asyncload", 0)] + [(s, k) for k in ks for s in args.systems]
    for system, k in steps:
        run = run_asyncload if system == "asyncload" else run_dataloader
        r = run(url, args.rows, k, args.batch_size, args.epochs)
        rows.append(r)
        e1, e2 = r.epochs[0], r.epochs[-1]
        print(
            f"{r.label:45s} epoch 1 {e1.samples_per_s:7,.0f}/s (first batch {e1.first_batch_s:5.2f}s)  "
            f"epoch 2 {e2.samples_per_s:7,.0f}/s (first batch {e2.first_batch_s:6.3f}s)  "
            f"load {os.getloadavg()[0]:.1f}", flush=True,
        )  # fmt: skip
        write(out, rows, info, args)  # after every step: a run cut short keeps what it measured
    plot(rows, info, out / "scaling.png")
    print(f"\n{table(rows, info, args)}\nwritten to {out}")
    return 0


def write(out: Path, rows: list[Row], info: dict[str, Any], args: argparse.Namespace) -> None:
    info["load_average_end"] = os.getloadavg()[0]
    result = {
        "machine": info, "rows": args.rows, "batch_size": args.batch_size, "epochs": args.epochs,
        "command": " ".join(["python", *sys.argv]),
        "runs": [asdict(r) | {"per_epoch": [
            {"samples_per_s": e.samples_per_s, "after_first_per_s": e.after_first_per_s} for e in r.epochs
        ]} for r in rows],
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "table.md").write_text(table(rows, info, args))


if __name__ == "__main__":
    sys.exit(main())
