"""asyncload against its peers, each in a fresh process, one whole cold first epoch: ``make bench``.

    python benchmarks/suites/wan.py [--config configs/bench_wan.yaml] [--set key=value ...]

The config names datasets (photo-like, ``testbeds/photos.py``), readers (``peers/``: a reader and its
options, under the label the tables print) and sections: which readers read which dataset where (local
disk, or SeaweedFS behind each round-trip time of ``latencies_ms``), in which order, how many times.

1. ``testbeds.world``: the emulated network (packet-level NFQUEUE as root, else the TCP proxy; every
   report names which), SeaweedFS in the server namespace, each dataset written once and uploaded.
2. For each section and place: the path check (small GET, handshake, window growth), then every reader,
   readers interleaved within a repetition so that drift on a shared machine hits all of them; each run a
   fresh process (``peers.harness.Runner``), under ``/tmp/asyncload-measure.lock`` so that no two
   measurements on this machine overlap, with a node block store of its own, empty, removed after
   (``asyncload.tools.coldstore``): no run reads what an earlier one fetched.
   With ``pin_cores: true`` (``make bench-pinned``) the server side runs on one core and every reader on
   the other, so that each reader has the same CPU whatever the server and the delay line spend.
3. ``results.json`` after every run (a run cut short keeps what it measured), then ``table.md`` (and a
   plot where a section sweeps latency) by ``reports/comparison.py``, ratios against the config's
   ``baseline`` reader in the same section, place and order.

``suites/augment.py`` is this suite with another config and the same report.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run as a file (make, ``asyncload bench``): the checkout's packages first

from asyncload.errors import ConfigError  # noqa: E402
from asyncload.runtime.settings import load_config, parse_overrides, setting, validate  # noqa: E402

ORDERS = ("sequential", "shuffled")  # and "blocks:B:W": asyncload's block order (peers.harness.index_order)
READER_KINDS = ("column", "ceiling", "bytes", "spdl", "asyncload", "sync", "pytorch", "augref")
LOCK = "/tmp/asyncload-measure.lock"


def _pos(v: Any) -> bool:
    return v > 0


@dataclass(frozen=True)
class ReaderSpec:
    """One row of the tables: a peer (``peers/``), its DataLoader workers, its options."""

    reader: str = setting("column", f"one of {READER_KINDS}", lambda v: v in READER_KINDS)
    workers: int = setting(0, "an int >= 0 (DataLoader workers)", lambda v: v >= 0)
    options: dict[str, Any] = field(default_factory=dict)
    #: seconds after its first batch at which a run of this reader is stopped (``None``: the section's or
    #: the suite's): the synchronous DataLoaders, which would take minutes for an epoch, stop early
    epoch_s: float | None = setting(None, "seconds > 0, or null", lambda v: v is None or v > 0)
    #: environment variables set in the measured process before it opens the dataset (Deep Lake's disk
    #: cache: ``DEEPLAKE_FS_CACHE_PATH``, ``DEEPLAKE_FS_CACHE_SIZE_MB``); ``{run}`` is a fresh directory
    env: dict[str, str] = field(default_factory=dict)
    #: the index order this reader reads in, instead of the section's (a plain reader given asyncload's
    #: block order: ``blocks:B:W``)
    order: str | None = setting(None, "null, or an order as sections take them", lambda v: v is None or _orders_ok([v]))

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class DatasetConfig:
    """A photo-like dataset (``testbeds/photos.py``); ``size: null`` for variable shapes."""

    rows: int = setting(1000, "an int >= 64", lambda v: v >= 64)
    image_format: str = setting("jpg", "'jpg' or 'png'", lambda v: v in ("jpg", "png"))
    size: int | None = setting(
        256, "an int >= 16, or null (240-640 px, aspect 0.6-1.7)", lambda v: v is None or v >= 16
    )
    mask_format: str = setting("lz4", "'lz4' or 'png'", lambda v: v in ("lz4", "png"))
    noise_std: tuple[float, float] = (1.5, 3.5)
    maker: str = setting(
        "photos",
        "'photos' (testbeds/photos.py) or 'synthetic' (asyncload.make_dataset)",
        lambda v: v in ("photos", "synthetic"),
    )
    upload: bool = True
    #: make this many different rows and store each rows/distinct times (``photos.make_photo_dataset``):
    #: a several-GB dataset in a minute instead of half an hour
    distinct: int | None = setting(None, "null or an int >= 64", lambda v: v is None or v >= 64)

    def __post_init__(self) -> None:
        validate(self)


def _orders_ok(v: Any) -> bool:
    def one(o: Any) -> bool:
        if o in ORDERS:
            return True
        parts = o.split(":") if isinstance(o, str) else []
        return len(parts) == 3 and parts[0] == "blocks" and all(x.isdigit() and int(x) >= 1 for x in parts[1:])

    return bool(v) and all(one(o) for o in v)


@dataclass(frozen=True)
class Section:
    """Which readers read one dataset where: ``latencies_ms`` over the emulated network, and local disk
    if ``local``; each (place, order, reader) ``repeats`` times, the median reported."""

    title: str = setting("", "a string")
    dataset: str = setting("", "a name from datasets")
    readers: tuple[str, ...] = ()
    latencies_ms: tuple[int, ...] = setting((50,), "a list of ints >= 0", lambda v: all(x >= 0 for x in v))
    local: bool = False
    local_readers: tuple[str, ...] = ()
    orders: tuple[str, ...] = setting(("shuffled",), f"a list from {ORDERS} or 'blocks:B:W'", _orders_ok)
    repeats: int = setting(3, "an int >= 1", _pos)
    repeats_other: int = setting(1, "an int >= 1 (latencies other than focus_ms)", _pos)
    focus_ms: int | None = None
    epoch_s: float | None = None
    #: read the first ``limit`` rows of each order, not all of them (null: the whole epoch)
    limit: int | None = setting(None, "null or an int >= 1", lambda v: v is None or v >= 1)

    def __post_init__(self) -> None:
        validate(self)

    def places(self) -> list[int | None]:
        """Where it reads: each latency, then local disk (``None``)."""
        return [*self.latencies_ms, *([None] if self.local else [])]

    def readers_at(self, place: int | None) -> tuple[str, ...]:
        return self.local_readers or self.readers if place is None else self.readers

    def repeats_at(self, place: int | None) -> int:
        focus = self.focus_ms if self.focus_ms is not None else (self.latencies_ms[0] if self.latencies_ms else None)
        return self.repeats if place is None or place == focus else self.repeats_other


def _nested(cls: type, where: str, value: Any) -> Any:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}={value!r} is not allowed: a mapping of {cls.__name__} keys")
    try:
        return load_config(value, cls)
    except ConfigError as exc:  # "Cls: key=value ..." -> "where: key=value ...": the path a user wrote
        raise ConfigError(f"{where}: {str(exc).removeprefix(cls.__name__ + ': ')}") from None


@dataclass(frozen=True)
class SuiteConfig:
    """The suite's settings (``configs/bench_wan.yaml``, ``configs/bench_augment.yaml``), checked whole
    before anything starts: nested datasets, readers and sections too, and every name they use."""

    title: str = "asyncload against its peers"
    datasets: dict[str, Any] = field(default_factory=dict)
    readers: dict[str, Any] = field(default_factory=dict)
    sections: tuple[Any, ...] = ()
    baseline: str = setting("", "a reader name: the ratios' denominator (empty: none)")
    epoch_s: float = setting(6.0, "seconds > 0 (a reader that has not finished the epoch by then is stopped)", _pos)
    run_timeout_s: float = setting(120.0, "seconds > 0", _pos)
    rate_mbit: float | None = None
    proxy: bool = False
    #: ``true``: the server, the delay line and this orchestrator on core 0, every measured reader's whole
    #: process tree on core 1 (``pinned``), so that every reader gets the same CPU and the ratios say what
    #: the client costs; ``false``: all share the machine's cores (the figures of earlier reports)
    pin_cores: bool = False
    out: str = "benchmarks/results/wan"
    data_dir: str = "data/bench"

    def __post_init__(self) -> None:
        validate(self)
        datasets = {k: _nested(DatasetConfig, f"datasets.{k}", v) for k, v in self.datasets.items()}
        readers = {k: _nested(ReaderSpec, f"readers.{k}", v) for k, v in self.readers.items()}
        sections = [_nested(Section, f"sections[{i}]", v) for i, v in enumerate(self.sections)]
        for i, s in enumerate(sections):
            if s.dataset not in datasets:
                raise ConfigError(f"sections[{i}].dataset={s.dataset!r} is not allowed: one of {list(datasets)}")
            for name in (*s.readers, *s.local_readers):
                if name not in readers:
                    raise ConfigError(f"sections[{i}].readers: {name!r} is not allowed: one of {list(readers)}")
        if self.baseline and self.baseline not in readers:
            raise ConfigError(f"baseline={self.baseline!r} is not allowed: one of {list(readers)}")
        object.__setattr__(self, "_parsed", (datasets, readers, sections))

    @property
    def parsed(self) -> tuple[dict[str, DatasetConfig], dict[str, ReaderSpec], list[Section]]:
        return self._parsed  # type: ignore[attr-defined,no-any-return]


def load_suite_config(path: str, overrides: list[str]) -> SuiteConfig:
    return load_config(path, SuiteConfig, overrides=parse_overrides(overrides))


Step = tuple[int, int | None, int, str, str]  # section, place (ms or None: local), repetition, order, reader


class Suite:
    def __init__(self, cfg: SuiteConfig) -> None:
        self.cfg = cfg
        self.datasets, self.readers, self.sections = cfg.parsed
        self.out = Path(cfg.out) if Path(cfg.out).is_absolute() else ROOT / cfg.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}
        self.meter: CoreMeter | None = None  # the server side's cores, when they are pinned apart

    def plan(self) -> list[Step]:
        steps: list[Step] = []
        for si, s in enumerate(self.sections):
            for place in s.places():
                for rep in range(s.repeats_at(place)):
                    steps += [(si, place, rep, o, r) for o in s.orders for r in s.readers_at(place)]
        return steps

    def prepare(self, world: Any) -> None:
        from benchmarks.testbeds.world import DatasetSpec, sizes

        wan = {name for s in self.sections if s.latencies_ms for name in [s.dataset]}
        self.specs = {}
        for name, d in self.datasets.items():
            self.specs[name] = DatasetSpec(
                d.rows, d.image_format, d.size, d.mask_format, tuple(d.noise_std), d.maker, d.distinct
            )
            world.add(name, self.specs[name], upload=d.upload and name in wan)
        self.meta = {
            **world.describe(),
            "title": self.cfg.title,
            "datasets": {
                n: {"describe": sp.describe(), "bytes_per_sample": sizes(world.local[n])}
                for n, sp in self.specs.items()
            },
            "sections": [asdict(s) for s in self.sections],
            "readers": {k: asdict(v) for k, v in self.readers.items()},
            "baseline": self.cfg.baseline,
            "method": "each run a fresh process reading one whole first epoch (or what it read within "
            f"{self._caps()} of its first batch) on a freshly opened dataset; samples/s from opening "
            "to the last sample; CPU (process tree, /proc) and peak RSS (tree, every 0.1 s) over the whole run; "
            "median of the repetitions; readers interleaved within a repetition; asyncload cold: its node block "
            "store a private, empty directory per run, removed after (``asyncload.tools.coldstore``; each "
            "asyncload run's ``asyncload_node_hits`` in results.json: 0)",
            "config": asdict(self.cfg),
        }

    def _caps(self) -> str:
        """The stop rule in words: the suite's cap, and each reader's own."""
        own = [f"{r.epoch_s:g} s for {name}" for name, r in self.readers.items() if r.epoch_s]
        return f"{self.cfg.epoch_s:g} s" + (f" ({'; '.join(own)})" if own else "")

    def spec(self, world: Any, s: Section, place: int | None, order: str, name: str) -> dict[str, Any]:
        r = self.readers[name]
        local = place is None or r.reader == "ceiling"
        return {
            "reader": r.reader,
            "workers": r.workers,
            "options": dict(r.options),
            "env": dict(r.env),
            "url": world.url(s.dataset, local),
            "creds": world.reader_creds(local),
            "order": r.order or order,
            "rows": self.datasets[s.dataset].rows,
            "limit": s.limit,
            "epoch_s": r.epoch_s or s.epoch_s or self.cfg.epoch_s,
        }

    def execute(self, world: Any, run: Any) -> None:
        from tqdm import tqdm

        checked: set[int] = set()
        bar = tqdm(self.plan(), desc="bench", unit="run", file=sys.stderr)
        for si, place, rep, order, name in bar:
            s = self.sections[si]
            where = "local disk" if place is None else f"{place} ms"
            bar.set_postfix_str(f"{s.dataset} {where} {order} {name}")
            if place is not None:
                world.set_rtt(place)
                if place not in checked:
                    checked.add(place)
                    self.rows.append(
                        {"loader": "netcheck", "latency_ms": place, "m": locked(run, world.path_check_spec(place))}
                    )
            m = locked(run, self.spec(world, s, place, order, name))
            span = m.get("span_unix")
            if self.meter is not None and span and None not in span:  # first batch to the end of the run
                m["server_cores_busy"] = self.meter.share(*span)
            self.rows.append(
                {
                    "section": si,
                    "dataset": s.dataset,
                    "loader": name,
                    "latency_ms": place,
                    "order": self.readers[name].order or order,
                    "rep": rep,
                    "m": m,
                }
            )
            if "error" in m:
                print(f"\n{name}, {s.dataset}, {where}, {order}: {m['error']}", file=sys.stderr)
            self.save()

    def save(self) -> None:
        doc = {**self.meta, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": self.rows}
        (self.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))


class CoreMeter:
    """How busy the server side's cores were while a reader read (``/proc/stat``, sampled every 0.1 s): on the
    pinned testbed, a server core near 100% busy means the server and the delay line set the pace of every
    reader there, and the readers' ratios of samples/s say nothing of their own cost (CPU per sample still
    does)."""

    def __init__(self, cores: set[int], every_s: float = 0.1) -> None:
        self.cores = {f"cpu{c}" for c in cores}
        self.samples: list[tuple[float, int, int]] = []  # (unix time, busy jiffies, all jiffies) of the cores
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), name="core-meter", daemon=True)
        self._thread.start()

    def _read(self) -> tuple[float, int, int]:
        from benchmarks.peers.harness import cpu_jiffies

        return (time.time(), *cpu_jiffies(self.cores))

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.samples.append(self._read())

    def share(self, t0: float, t1: float) -> float | None:
        """The cores' busy share between unix times ``t0`` and ``t1``, or None for a window too short to tell."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 3:
            return None
        (_, b0, a0), (_, b1, a1) = inside[0], inside[-1]
        return (b1 - b0) / (a1 - a0) if a1 > a0 else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def locked(run: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """``run(spec)`` holding the machine-wide measurement lock: no other measurement runs meanwhile."""
    with open(LOCK, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            return run(spec)  # type: ignore[no-any-return]
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pinned(pin: bool) -> tuple[set[int], set[int]]:
    """The cores of the server side and of the readers; with ``pin``, this process moves to the server's
    now, before the server and the delay line start, so that they inherit it. Needs two cores or more."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin:
        return set(cores), set(cores)
    if len(cores) < 2:
        raise ConfigError(f"pin_cores=true needs 2 cores or more; this process may run on {cores}")
    server, readers = {cores[0]}, set(cores[1:])
    os.sched_setaffinity(0, server)
    return server, readers


def main(argv: list[str] | None = None, default_config: str = "configs/bench_wan.yaml") -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / default_config))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    args = ap.parse_args(argv)
    try:
        cfg = load_suite_config(args.config, args.set)
    except ConfigError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    from benchmarks.peers.harness import Runner
    from benchmarks.reports.comparison import render
    from benchmarks.testbeds.world import world

    suite = Suite(cfg)
    t0 = time.perf_counter()
    server_cores, reader_cores = pinned(cfg.pin_cores)
    with world(ROOT / cfg.data_dir, rate_mbit=cfg.rate_mbit, force_proxy=cfg.proxy) as w:
        suite.prepare(w)
        suite.meta["config_file"] = os.path.relpath(Path(args.config).resolve(), ROOT)
        suite.meta["cores"] = (
            f"pinned: server, delay line and orchestrator on core(s) {sorted(server_cores)}, each reader's "
            f"process tree on core(s) {sorted(reader_cores)} (taskset-style affinity)"
            if cfg.pin_cores
            else f"shared: server, delay line and readers on all {len(server_cores)} cores"
        )
        os.sched_setaffinity(0, reader_cores)  # the runs' forkserver starts here: its children inherit it
        runner = Runner(cfg.run_timeout_s, enter=w.net.enter_client)
        os.sched_setaffinity(0, server_cores)
        suite.meter = CoreMeter(server_cores) if cfg.pin_cores else None
        try:
            suite.execute(w, runner)
        finally:
            if suite.meter is not None:
                suite.meter.close()
    suite.meta["wall_s"] = time.perf_counter() - t0
    suite.save()
    render(suite.out)
    print(f"\nwrote {suite.out}/results.json and table.md in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    print((suite.out / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
