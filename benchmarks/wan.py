"""asyncload against its peers on an emulated WAN, in one run: ``make bench``.

    python benchmarks/wan.py --config configs/bench_wan.yaml [--set key=value ...]

1. Sets up the network (``netem.py``): packet-level latency in network namespaces where the machine
   allows it, else the TCP proxy, and says which in every report.
2. Starts SeaweedFS (``harness.seaweed``) in the server namespace and puts the photo-like
   dataset (``photos.py``) on it; a local copy is the ceiling.
3. For each round-trip time: the path check (small-GET RTT, handshake, per-RTT growth of one large GET),
   then every reader of ``peers.py`` in sequential and shuffled order, each repetition in a fresh process
   (forked from a server that imported torch and Deep Lake but never read), first epoch, cold, on a freshly
   opened dataset; readers interleaved within a repetition so that drift on a shared machine hits all.
4. asyncload's alternatives (``variants``: options passed to ``DeepLakeSource``/``AsyncLoader``, the
   defaults untouched) at ``focus_ms``, for the diagnosis.
5. Writes ``results.json``, ``table.md`` and ``throughput_vs_latency.png`` under ``out`` (``wan_report.py``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT)]

import netem  # noqa: E402

from asyncload.config import load_config, parse_overrides, setting, validate  # noqa: E402
from asyncload.errors import ConfigError  # noqa: E402

PEERS = ("sync:0", "sync:2", "sync:4", "pytorch:4", "recipe", "spdl", "column", "column_late", "ceiling", "asyncload")
_ORDERS = ("sequential", "shuffled")


def _pos(v: Any) -> bool:
    return v > 0


@dataclass(frozen=True)
class WanConfig:
    """The run's settings (``configs/bench_wan.yaml``), validated before anything starts."""

    rows: int = setting(1000, "an int >= 64", lambda v: v >= 64)
    image_format: str = setting("png", "'png' or 'jpg'", lambda v: v in ("png", "jpg"))
    latencies_ms: tuple[int, ...] = setting((0, 20, 50, 100), "a list of ints >= 0", lambda v: all(x >= 0 for x in v))
    focus_ms: int = setting(50, "an int >= 0", lambda v: v >= 0)
    orders: tuple[str, ...] = setting(_ORDERS, "a list of 'sequential'/'shuffled'", lambda v: set(v) <= set(_ORDERS))
    readers: tuple[str, ...] = setting(PEERS, f"a list from {PEERS}", lambda v: set(v) <= set(PEERS))
    focus_only: tuple[str, ...] = setting((), f"a list from {PEERS}", lambda v: set(v) <= set(PEERS))
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    epoch_s: float = setting(6.0, "seconds > 0 (a reader that has not finished the epoch by then is stopped)", _pos)
    repeats: int = setting(3, "an int >= 1 (at focus_ms)", _pos)
    repeats_other: int = setting(1, "an int >= 1 (at the other latencies)", _pos)
    run_timeout_s: float = setting(90.0, "seconds > 0", _pos)
    rate_mbit: float | None = None
    proxy: bool = False
    out: str = "benchmarks/results/wan"
    data_dir: str = "data/bench"

    def __post_init__(self) -> None:
        validate(self)


def _child(spec: dict[str, Any], conn: Any) -> None:
    """In the forked child (already in the client's namespace): measure, send, exit hard (Deep Lake's
    threads can crash a normal interpreter exit after ``get_async``; the result is already out)."""
    try:
        import peers

        if spec["reader"] == "netcheck":
            out = netem.check_path(spec["url"], spec["bucket"], spec["rtt_s"])
        else:
            out = peers.measure_reader(spec)
    except BaseException as exc:  # noqa: BLE001 - reported, never raised across processes
        out = {"error": f"{type(exc).__name__}: {exc}"}
    conn.send(out)
    conn.close()
    os._exit(0)


class Runner:
    """Fresh processes from one forkserver that preloaded the heavy imports (~3 s each otherwise).

    The forkserver starts inside the client's namespace (``netem.inside``), so every thread of every
    child, including those Deep Lake recreates at fork time, is on the emulated path.
    """

    def __init__(self, net: netem.Network, timeout_s: float) -> None:
        from multiprocessing import forkserver

        self.timeout_s = timeout_s
        self.ctx = mp.get_context("forkserver")
        # Every asyncload module, not just the package: a module imported lazily in a child would come
        # from disk, and in a checkout being edited meanwhile it may no longer match the preloaded ones.
        import pkgutil

        import asyncload

        ours = [
            m.name
            for m in pkgutil.walk_packages(asyncload.__path__, "asyncload.")
            if not m.name.endswith("__main__") and ".testing" not in m.name
        ]
        self.ctx.set_forkserver_preload(
            ["torch", "deeplake", "asyncload", *ours, "spdl.pipeline", "peers", "netem", "baselines", "recipe"]
        )
        with netem.inside(net.enter_client):
            forkserver.ensure_running()

    def __call__(self, spec: dict[str, Any], on_start: Any = None) -> dict[str, Any]:
        """``spec`` measured in a fresh child; ``on_start(pid)`` is called once it runs (the probe's hook)."""
        recv, send = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=_child, args=(spec, send), daemon=False)
        p.start()
        send.close()
        if on_start is not None:
            on_start(p.pid)
        try:
            out = recv.recv() if recv.poll(self.timeout_s) else {"error": f"no result within {self.timeout_s:.0f}s"}
        except EOFError:
            out = {"error": "the process died without a result"}
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
        if p.exitcode not in (0, None) and "error" not in out:
            out["exitcode"] = p.exitcode
        return out


def _label(reader: str, variant: str | None = None) -> str:
    kind, _, arg = reader.partition(":")
    names = {
        "sync": f"sync Dataset + DataLoader, {arg} workers",
        "pytorch": f"ds.pytorch() + DataLoader, {arg} workers",
        "recipe": "published asyncio recipe (128 coroutines)",
        "spdl": "SPDL 0.8 pipeline, per-row get_async, 64",
        "column": "plain column get_async (64 × 4 in flight, pool 64)",
        "column_late": "plain column reader, pool set to 64 after opening",
        "ceiling": "plain column reader on a local copy (ceiling)",
        "asyncload": "asyncload, defaults",
    }
    return f"asyncload, {variant}" if variant else names[kind]


class WanBench:
    def __init__(self, cfg: WanConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}

    def prepare(self, net: netem.Network, server: Any) -> None:
        """Local copy (cached between runs) and the S3 copy, plus the path-check objects."""
        import deeplake
        from photos import bytes_per_sample, make_photo_dataset

        cfg = self.cfg
        local = ROOT / cfg.data_dir / f"photos-{cfg.rows}-{cfg.image_format}"
        self.local_url = f"file://{local}"
        if not deeplake.exists(self.local_url) or len(deeplake.open_read_only(self.local_url)) != cfg.rows:
            print(f"writing {self.local_url}", file=sys.stderr)
            make_photo_dataset(self.local_url, cfg.rows, image_format=cfg.image_format)  # type: ignore[arg-type]
        self.bucket = server.create_bucket("bench")
        server.put_tree(self.bucket, "photos", local)  # the same bytes, no re-encoding
        netem.put_check_objects(server, self.bucket)
        self.creds = {**server.creds(), "endpoint_url": net.url(server.port)}
        self.s3_url = f"s3://{self.bucket}/photos"
        self.filer = net.url(int(server.filer_url.rsplit(":", 1)[1]))
        sizes = bytes_per_sample(self.local_url)
        self.meta = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, deeplake {deeplake.__version__}",
            "dataset": f"{cfg.rows} rows of photo-like 256x256x3 {cfg.image_format} images + lz4 masks (benchmarks/photos.py)",
            "bytes_per_sample": {**sizes, "total": sum(sizes.values())},
            "network": net.describe(),
            "server": "SeaweedFS weed mini (harness.seaweed) in the server namespace",
            "method": f"each repetition a fresh process reading one whole first epoch ({cfg.rows} rows, or what it read "
            f"within {cfg.epoch_s:g} s of its first batch) on a freshly opened dataset; samples/s from the first batch "
            f"to the last, and from open to the last; CPU, RSS and bytes over the whole process; median of "
            f"{cfg.repeats} at {cfg.focus_ms} ms, {cfg.repeats_other} elsewhere",
            "config": asdict(self.cfg),
        }

    def plan(self) -> list[tuple[int, int, str, str, str | None]]:
        """(latency, repetition, order, reader, variant), readers interleaved within a repetition."""
        cfg = self.cfg
        steps = []
        for lat in cfg.latencies_ms:
            reps = cfg.repeats if lat == cfg.focus_ms else cfg.repeats_other
            steps.append((lat, 0, "-", "netcheck", None))
            for rep in range(reps):
                for order in cfg.orders:
                    for reader in cfg.readers:
                        if reader == "recipe" and order != "sequential":
                            continue  # it reads in its own (sequential) order
                        if reader in cfg.focus_only and lat != cfg.focus_ms:
                            continue
                        steps.append((lat, rep, order, reader, None))
                    if lat == cfg.focus_ms:
                        steps += [(lat, rep, order, "asyncload", name) for name in cfg.variants]
        return steps

    def spec(self, lat: int, order: str, reader: str, variant: str | None) -> dict[str, Any]:
        cfg = self.cfg
        kind, _, arg = reader.partition(":")
        local = kind == "ceiling"
        return {
            "reader": kind,
            "workers": int(arg or 0),
            "url": self.local_url if local else self.s3_url,
            "creds": None if local else self.creds,
            "order": order,
            "rows": cfg.rows,
            "epoch_s": cfg.epoch_s,
            "options": cfg.variants.get(variant, {}) if variant else {},
        }

    def execute(self, net: netem.Network, run: Runner) -> None:
        from tqdm import tqdm

        bar = tqdm(self.plan(), desc="bench", unit="run", file=sys.stderr)
        for lat, rep, order, reader, variant in bar:
            bar.set_postfix_str(f"{lat} ms {order} {reader} {variant or ''}")
            if net.rtt_s != lat / 1e3:
                net.set_rtt(lat / 1e3)
            if reader == "netcheck":
                m = run({"reader": "netcheck", "url": self.filer, "bucket": self.bucket, "rtt_s": lat / 1e3})
                self.rows.append({"loader": "netcheck", "latency_ms": lat, "m": m})
            else:
                m = run(self.spec(lat, order, reader, variant))
                label = _label(reader, variant)
                self.rows.append(
                    {
                        "loader": label,
                        "reader": reader,
                        "variant": variant,
                        "latency_ms": lat,
                        "order": order,
                        "rep": rep,
                        "m": m,
                    }
                )
                if "error" in m:
                    print(f"\n{label} at {lat} ms {order}: {m['error']}", file=sys.stderr)
            self.save()

    def save(self) -> None:
        doc = {**self.meta, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": self.rows}
        (self.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "bench_wan.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.config, WanConfig, overrides=parse_overrides(args.set))
    except ConfigError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    bench = WanBench(cfg)
    t0 = time.perf_counter()
    with netem.network(ROOT / "data" / "netem", rate_mbit=cfg.rate_mbit, force_proxy=cfg.proxy) as net:
        net.enter_server()  # the orchestrator sets up and uploads from the server's side: no delay
        from harness.seaweed import SeaweedServer

        with SeaweedServer(host=net.server_host) as server:
            bench.prepare(net, server)
            bench.execute(net, Runner(net, cfg.run_timeout_s))
    bench.meta["wall_s"] = time.perf_counter() - t0
    bench.save()
    from wan_report import render

    render(bench.out)
    print(
        f"\nwrote {bench.out}/results.json, table.md, throughput_vs_latency.png in {time.perf_counter() - t0:.0f}s",
        file=sys.stderr,
    )
    print((bench.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
