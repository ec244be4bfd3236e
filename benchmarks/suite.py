"""Synchronous against asynchronous loading under emulated network latency, in one run, on one dataset.

    python benchmarks/suite.py --config configs/bench.yaml        (what ``make bench`` runs)

What it does:
1. starts a real S3-compatible server (SeaweedFS ``weed mini``) and writes the synthetic segmentation
   dataset to it, plus a local-disk copy (the ceiling: what a loader reaches if latency were hidden);
2. puts a TCP delay line (a process of its own, so it takes no GIL time from the loaders) in front of
   the server and, for each round-trip latency in the config, checks
   the path (connect, small GET, one large GET) and measures every loader through it:
   the synchronous map-style Dataset and Deep Lake's ``ds.pytorch()`` through DataLoader with 0/2/4
   spawn workers, the published asyncio recipe (own process), asyncload (default settings, a
   concurrency sweep of per-row and column reads, the process fan-out), and a training-step
   simulation that reports the fraction of step time spent waiting for data;
3. writes ``results.json``, ``table.md`` and PNG plots to the output folder.

Every measurement reads one epoch through a freshly opened dataset, stopping early at ``max_seconds``:
Deep Lake caches chunks per dataset handle (an in-memory cache of up to 1 GB), so a second epoch on the
same handle reads from memory, not from the network (measured: 70 samples/s cold, 900+ warm, at 50 ms).
Throughput counts the samples after the first batch over the time to the last one; CPU
seconds per sample include DataLoader workers; peak RSS covers the process tree. asyncload's
configurations are measured ``repeats`` times (median), the slower baselines once.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import deeplake  # noqa: E402
import torch  # noqa: E402
from baselines import SyncSegDataset, deeplake_pytorch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from tqdm import tqdm  # noqa: E402

from asyncload import AsyncLoader, DeepLakeSource, make_dataset  # noqa: E402
from asyncload.config import load_config, parse_overrides, setting, validate  # noqa: E402
from asyncload.errors import ConfigError  # noqa: E402
from asyncload.measure import Measurement, measure  # noqa: E402
from harness.delayline import DelayLineProcess  # noqa: E402
from harness.netcheck import measure_path  # noqa: E402
from harness.seaweed import SeaweedServer  # noqa: E402


def _positive(v: Any) -> bool:
    return v > 0


def _all(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda vs: all(ok(v) for v in vs)


@dataclass(frozen=True)
class BenchConfig:
    """The suite's settings (``configs/bench.yaml``), validated: an unknown key, a wrong type or an
    impossible value fails before anything starts, naming the key, the value and what is allowed."""

    rows: int = setting(512, "an int >= 64", lambda v: v >= 64)
    height: int = setting(256, "an int >= 8", lambda v: v >= 8)
    width: int = setting(256, "an int >= 8", lambda v: v >= 8)
    image_format: Literal["png", "jpg"] = "png"
    batch_size: int = setting(32, "an int >= 1", _positive)
    latencies_ms: tuple[int, ...] = setting((0, 20, 50, 100), "a list of ints >= 0", _all(lambda v: v >= 0))
    sweep_latencies_ms: tuple[int, ...] = (50,)
    concurrency_sweep: tuple[int, ...] = setting((1, 8, 32, 64, 128, 256, 512), "a list of ints >= 1", _all(_positive))
    read_modes: tuple[str, ...] = setting(
        ("column", "row"), "a list of 'row'/'column'", _all(lambda v: v in ("row", "column"))
    )
    concurrency: int | str = setting(
        "auto", "'auto' or an int >= 1", lambda v: v == "auto" or (isinstance(v, int) and v >= 1)
    )
    dataloader_workers: tuple[int, ...] = setting((0, 2, 4), "a list of ints >= 0", _all(lambda v: v >= 0))
    processes: tuple[int, ...] = setting((), "a list of ints >= 1", _all(_positive))
    recipe: bool = True
    max_samples: int = setting(100_000, "an int >= 1 (at most one epoch is read)", _positive)
    max_seconds: float = setting(6.0, "seconds > 0", _positive)
    repeats: int = setting(3, "an int >= 1", _positive)
    step_ms: float = setting(100.0, "milliseconds > 0", _positive)
    train_batches: int = setting(10, "an int >= 0", lambda v: v >= 0)
    out: str = "benchmarks/results/latest"
    data_dir: str = "data/bench"

    def __post_init__(self) -> None:
        validate(self)


@dataclass
class Row:
    """One measured configuration."""

    loader: str
    latency_ms: int | None
    settings: dict[str, Any]
    m: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def load_bench_config(path: str | None, overrides: list[str]) -> BenchConfig:
    return load_config(path, BenchConfig, overrides=parse_overrides(overrides))


def median_measure(runs: list[Measurement]) -> Measurement:
    return sorted(runs, key=lambda m: m.samples_per_s)[len(runs) // 2]


class Suite:
    def __init__(self, cfg: BenchConfig) -> None:
        self.cfg = cfg
        self.rows: list[Row] = []
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)

    # -- set-up ------------------------------------------------------------------------------------
    def prepare(self, server: SeaweedServer) -> None:
        cfg = self.cfg
        self.bucket = server.create_bucket("bench")
        self.s3_url = f"s3://{self.bucket}/seg"
        self.local_url = "file://" + os.path.abspath(
            os.path.join(cfg.data_dir, f"seg-{cfg.rows}-{cfg.height}-{cfg.image_format}")
        )
        shape = {"height": cfg.height, "width": cfg.width, "image_format": cfg.image_format}
        if not deeplake.exists(self.local_url) or len(deeplake.open_read_only(self.local_url)) != cfg.rows:
            make_dataset(self.local_url, cfg.rows, overwrite=True, **shape)  # type: ignore[arg-type]
        make_dataset(self.s3_url, cfg.rows, creds=server.creds(), progress=True, **shape)  # type: ignore[arg-type]
        server.put_object(self.bucket, "netcheck/small", b"x" * 100)
        server.put_object(self.bucket, "netcheck/large", os.urandom(8 << 20))

    # -- one measurement ---------------------------------------------------------------------------
    def run(
        self,
        loader: str,
        latency_ms: int | None,
        settings: dict[str, Any],
        make: Callable[[], Iterable[Any]],
        repeats: int = 1,
        **kw: Any,
    ) -> Row:
        cfg = self.cfg
        limit = min(cfg.max_samples, cfg.rows)
        runs = [measure(loader, make(), max_samples=limit, max_seconds=cfg.max_seconds, **kw) for _ in range(repeats)]
        m = median_measure(runs)
        row = Row(loader, latency_ms, settings, m.as_dict())
        self.rows.append(row)
        return row

    def dataloader(self, ds: torch.utils.data.Dataset, workers: int) -> Iterator[Any]:  # type: ignore[type-arg]
        """One epoch through a DataLoader (workers open the dataset fresh)."""
        ctx = "spawn" if workers else None
        return iter(DataLoader(ds, batch_size=self.cfg.batch_size, num_workers=workers, multiprocessing_context=ctx))

    def asyncload(self, url: str, creds: dict[str, str] | None, **options: Any) -> Iterator[Any]:
        """One epoch through an AsyncLoader on a freshly opened dataset; the handle is dropped after.

        With ``concurrency="auto"`` one warm-up epoch runs first, unmeasured (a training run keeps its
        tuner across epochs), and the dataset is reopened after it so the measured reads stay cold.
        """
        src = DeepLakeSource(url, creds=creds)
        loader = AsyncLoader(src, self.cfg.batch_size, **options)
        if options.get("concurrency") == "auto" and not options.get("processes"):
            warm = iter(loader)
            t0 = time.perf_counter()
            for _ in warm:
                if time.perf_counter() - t0 > self.cfg.max_seconds:
                    break
            warm.close()
            src.close()
            loader.set_epoch(1)

        def epoch() -> Iterator[Any]:
            try:
                yield from loader
            finally:
                src.close()

        return epoch()

    def recipe(self, url: str, creds: dict[str, str], latency_ms: int) -> None:
        """The published recipe leaks its threads by design: measure it in a process of its own."""
        env = {**os.environ, "ASYNCLOAD_BENCH_CREDS": json.dumps(creds)}
        limit = min(self.cfg.max_samples, self.cfg.rows)
        cmd = [
            sys.executable,
            str(HERE / "recipe.py"),
            url,
            str(limit),
            str(self.cfg.max_seconds),
            str(self.cfg.batch_size),
        ]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=self.cfg.max_seconds * 4 + 60)
            m = json.loads(p.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, IndexError, json.JSONDecodeError) as exc:
            m = {"error": f"{type(exc).__name__}: {exc}"}
        self.rows.append(Row("published recipe (128 coroutines)", latency_ms, {"batch_size": self.cfg.batch_size}, m))

    def train_sim(self, name: str, latency_ms: int | None, batches: Iterable[Any]) -> None:
        """A training loop whose step takes ``step_ms`` (a GPU step: sleeps, holding no GIL)."""
        cfg = self.cfg
        wait = 0.0
        steps = 0
        it = iter(batches)
        t0 = time.perf_counter()
        try:
            while steps < cfg.train_batches:
                w0 = time.perf_counter()
                try:
                    next(it)
                except StopIteration:
                    break
                if steps:  # the first batch includes start-up: not a steady-state wait
                    wait += time.perf_counter() - w0
                time.sleep(cfg.step_ms / 1e3)
                steps += 1
        finally:
            close = getattr(it, "close", None)
            if close:
                close()
            del it
        total = time.perf_counter() - t0
        step_total = (steps - 1) * cfg.step_ms / 1e3
        frac = wait / (wait + step_total) if steps > 1 else None
        self.rows.append(
            Row(
                f"train-step sim: {name}",
                latency_ms,
                {"step_ms": cfg.step_ms},
                {"data_wait_fraction": frac, "steps": steps, "seconds": total},
            )
        )

    # -- the whole suite ---------------------------------------------------------------------------
    def plan(self) -> list[tuple[int, str]]:
        cfg = self.cfg
        steps: list[tuple[int, str]] = []
        for lat in cfg.latencies_ms:
            steps.append((lat, "netcheck"))
            steps += [(lat, f"sync:{w}") for w in cfg.dataloader_workers]
            steps += [(lat, f"pytorch:{w}") for w in cfg.dataloader_workers]
            if cfg.recipe:
                steps.append((lat, "recipe"))
            steps.append((lat, "asyncload"))
            steps += [(lat, f"fanout:{k}") for k in cfg.processes]
            if lat in cfg.sweep_latencies_ms:
                steps += [(lat, f"sweep:{mode}:{c}") for mode in cfg.read_modes for c in cfg.concurrency_sweep]
            if cfg.train_batches > 0:
                steps += [(lat, "train:sync"), (lat, "train:asyncload")]
        steps.append((-1, "ceiling"))
        return steps

    def execute(self, server: SeaweedServer) -> None:
        cfg = self.cfg
        filer = server.filer_url.removeprefix("http://")
        fhost, fport = filer.split(":")
        with (
            DelayLineProcess((server.host, server.port)) as s3_line,
            DelayLineProcess((fhost, int(fport))) as filer_line,
        ):
            creds = {**server.creds(), "endpoint_url": s3_line.url}
            bar = tqdm(self.plan(), desc="bench", unit="run", file=sys.stderr)
            url = self.s3_url
            for lat, what in bar:
                bar.set_postfix_str(f"{what} @ {lat} ms" if lat >= 0 else what)
                if lat >= 0:
                    s3_line.set_rtt(lat / 1e3)
                    filer_line.set_rtt(lat / 1e3)
                kind, _, arg = what.partition(":")
                if kind == "netcheck":
                    path = measure_path(
                        filer_line.url,
                        small_path=f"/buckets/{self.bucket}/netcheck/small",
                        large_path=f"/buckets/{self.bucket}/netcheck/large",
                        n=10,
                        fresh=3,
                    )
                    self.rows.append(Row("netcheck", lat, {}, path))
                elif kind == "sync":
                    w = int(arg)
                    self.run(
                        f"sync Dataset + DataLoader, {w} workers",
                        lat,
                        {"workers": w},
                        lambda w=w: self.dataloader(SyncSegDataset(url, creds), w),
                    )
                elif kind == "pytorch":
                    w = int(arg)
                    self.run(
                        f"ds.pytorch() + DataLoader, {w} workers",
                        lat,
                        {"workers": w},
                        lambda w=w: self.dataloader(deeplake_pytorch(url, creds), w),
                    )
                elif kind == "recipe":
                    self.recipe(url, creds, lat)
                elif kind == "asyncload":
                    self.run(
                        f"asyncload, concurrency {cfg.concurrency}",
                        lat,
                        {"concurrency": cfg.concurrency, "read_mode": "auto"},
                        lambda: self.asyncload(url, creds, concurrency=cfg.concurrency),
                        repeats=cfg.repeats,
                    )
                elif kind == "fanout":
                    k = int(arg)
                    self.run(
                        f"asyncload, {k} processes",
                        lat,
                        {"processes": k, "concurrency": cfg.concurrency},
                        lambda k=k: self.asyncload(url, creds, concurrency=cfg.concurrency, processes=k),
                    )
                elif kind == "sweep":
                    mode, c = arg.split(":")
                    self.run(
                        f"asyncload {mode}, concurrency {c}",
                        lat,
                        {"sweep": True, "read_mode": mode, "concurrency": int(c)},
                        lambda mode=mode, c=c: self.asyncload(url, creds, concurrency=int(c), read_mode=mode),
                        repeats=cfg.repeats,
                    )
                elif kind == "train":
                    if arg == "sync":
                        self.train_sim(
                            "sync DataLoader, 0 workers", lat, self.dataloader(SyncSegDataset(url, creds), 0)
                        )
                    else:
                        self.train_sim(
                            f"asyncload, concurrency {cfg.concurrency}",
                            lat,
                            self.asyncload(url, creds, concurrency=cfg.concurrency),
                        )
                elif kind == "ceiling":
                    self.run(
                        f"asyncload on local disk (ceiling), concurrency {cfg.concurrency}",
                        None,
                        {"concurrency": cfg.concurrency},
                        lambda: self.asyncload(self.local_url, None, concurrency=cfg.concurrency),
                        repeats=cfg.repeats,
                    )
                self.save()

    # -- output ------------------------------------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        return {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"torch {torch.__version__}, deeplake {deeplake.__version__}",
            "dataset": f"{self.cfg.rows} rows, {self.cfg.height}x{self.cfg.width}x3 {self.cfg.image_format} images + lz4 masks",
            "server": "SeaweedFS weed mini on loopback, behind harness.delayline.DelayLine",
            "config": asdict(self.cfg),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }

    def save(self) -> None:
        with open(self.out / "results.json", "w") as f:
            json.dump({**self.meta(), "rows": [asdict(r) for r in self.rows]}, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(HERE.parent / "configs" / "bench.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = ap.parse_args(argv)
    try:
        cfg = load_bench_config(args.config, args.set)
    except ConfigError as exc:
        print(f"asyncload bench: {exc}", file=sys.stderr)
        return 2
    suite = Suite(cfg)
    t0 = time.perf_counter()
    with SeaweedServer() as server:
        suite.prepare(server)
        suite.execute(server)
    suite.save()
    from report import render

    render(suite.out)
    print(f"\nwrote {suite.out}/results.json, table.md and plots in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    print((suite.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
