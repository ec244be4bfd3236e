"""``asyncload load``: one user's dataset read by asyncload and by a synchronous loop, timed alike.

What it answers: "how much faster does asyncload read *my* data, here, with these settings?". So:

- **Any dataset.** A Deep Lake dataset (any path or URL Deep Lake opens), or image files under an object
  store prefix (``ObjectStoreSource``: ``<prefix>/<column>/<stem>.<ext>``). ``--source auto`` decides by
  opening the URL with Deep Lake (outside the timing): a dataset there, Deep Lake; none, and the URL is an
  ``s3://``, ``gs://`` or ``az://`` prefix, the files under it; ``http(s)://`` is always files (with
  ``--manifest``); ``--source deeplake|files`` says it outright. ``--mix URL=WEIGHT`` (repeatable) reads a
  ``MixedSource`` of the URL and those datasets (``mix_of``), with ``--weight`` the URL's own weight and
  ``--epoch-rows`` the rows of an epoch; the baseline then reads the mixture's rows one at a time.
- **Photos of any size**: the augmentation flags map to the loader's own ``augment=`` ops (``--resize``:
  ``Resize``, ``--crop``: ``RandomResizedCrop``, ``--flip``: ``RandomHorizontalFlip``), ``--ragged`` to
  ``ragged=``, ``--normalize``/``--layout``/``--dtype`` to the model-ready settings.
- **An honest figure.** Each run is a whole epoch from nothing: the source is made and opened (and a
  reader process started) inside the timing, and the clock stops at the last sample. That figure,
  "epoch samples/s (open included)", leads; the steady rate (first batch to last) is beside it,
  labelled. The synchronous baseline is timed the same way: open included, to its last row. ``--repeat
  N`` runs both N times, alternating, and reports the median and the range.
- **The same work per sample.** The baseline (``baseline.SyncRun``) decodes each row and then crops,
  resizes, flips and normalizes it as the loader's settings do, so the ratio compares reading strategies,
  not different work. The report is made in ``report``.
- **Cold against cold.** asyncload keeps what it fetched in the node block store on local disk
  (``nodestore``), for every later epoch and run on the machine: a run after the first would
  read the dataset from there. So each asyncload run reads through a private, empty store
  (``coldstore``), removed after: every run's first epoch fetches everything, as the baseline's does,
  in this invocation and the next. ``--epochs N`` runs N epochs on one open dataset and reports epochs
  2..N apart, labelled warm (asyncload reads them from the store that epoch 1 filled, the baseline from
  what its own caches hold), each against the baseline's own later epochs. A store the user names
  (``--cache-dir``, ``--warm``) is used as it is, and each run labelled by what it found there; every
  run in the JSON names its state and the bytes it fetched from the source (``stats()``).
- **What it cost**: CPU per sample over the whole process tree (this process and its reaped children:
  each loader is closed, its reader process joined, before the clock's CPU is read) and the peak RSS of
  the tree (sampled every 20 ms).
- **Where it ran**: local disk, or the endpoint read. The command emulates no latency: the figures are
  those of the network as it is.

The baseline's runs share this process. Deep Lake keeps what an open dataset read while it stays open (a
baseline's later epoch is largely read from there: 256 PNG rows at 50 ms, epoch 1 37/s, epoch 2 1,191/s),
but each run opens the dataset anew, and its epoch 1 read at the same rate in every run (37-38/s).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .baseline import SyncRun
from .measure import Measurement, cpu_stages, measure

#: URL schemes whose prefixes ``ObjectStoreSource`` reads (Deep Lake names GCS ``gcs://``, not ``gs://``).
CLOUD_SCHEMES = ("s3", "gs", "az", "azure", "http", "https")
NORMALIZE = {
    "imagenet": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
    "half": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}


@dataclass(frozen=True)
class Where:
    """The dataset a comparison reads: how to make a fresh source of it, and what to call it."""

    kind: str  # "deeplake", "files" or "mixed"
    url: str
    why: str  # how the kind was chosen
    network: str  # "local disk", "endpoint http://...", ...
    make: Callable[[], Any] = field(repr=False)  # a new, unopened source


def scheme_of(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else ""


def network_of(url: str, creds: Mapping[str, str] | None, profile: str | None) -> str:
    """Where the bytes come from, in words: local disk, memory, or the endpoint (never a secret)."""
    scheme = scheme_of(url)
    if scheme in ("", "file"):
        return "local disk"
    if scheme == "mem":
        return "memory (this process)"
    endpoint = (creds or {}).get("endpoint_url") or os.environ.get("AWS_ENDPOINT_URL")
    if scheme == "s3":
        if endpoint:
            return f"S3 endpoint {endpoint}"
        return f"S3 (profile {profile}'s endpoint, else AWS's)" if profile else "S3 (AWS's endpoint)"
    if scheme in ("http", "https"):
        return f"HTTP {url.split('/', 3)[2]}"
    return f"{scheme}:// (the cloud's endpoint)"


def choose_source(
    url: str, columns: Sequence[str], kind: str, *, creds: Mapping[str, str] | None = None,
    token: str | None = None, profile: str | None = None, version: str | None = None, query: str | None = None,
    manifest: str | None = None,
) -> tuple[Where, int]:  # fmt: skip
    """Which source reads ``url`` (see the module docstring), and its rows. The source is opened once
    here, before anything is timed, so a missing dataset, column or bucket fails as asyncload's named
    error and not from inside a timed run."""
    from ..errors import DatasetNotFoundError
    from ..sources.deeplake import DeepLakeSource, normalize_url

    files_ok = scheme_of(url) in CLOUD_SCHEMES
    if kind == "files" and not files_ok:
        raise ConfigError(
            f"--source files is not allowed for {url}: object-store files are read from s3://, gs://, az:// or "
            "http(s):// prefixes (a local folder of files: make a Deep Lake dataset of it, see docs/guides/own-data.md)"
        )
    if kind == "files" and (version or query):
        raise ConfigError("--version and --query are not allowed with --source files: they are Deep Lake's")
    network = network_of(url, creds, profile)

    def make_deeplake() -> Any:
        return DeepLakeSource(
            url, tuple(columns), creds=creds, token=token, version=version, query=query, profile=profile
        )

    def make_files() -> Any:
        from ..sources.objectstore import ObjectStoreSource

        return ObjectStoreSource(url, tuple(columns), creds=creds, manifest=manifest, profile=profile)

    why = f"--source {kind}"
    if kind == "auto" and scheme_of(url) in ("http", "https"):
        kind, why = "files", "an http(s):// prefix: files (Deep Lake does not read over plain HTTP)"
    if kind in ("auto", "deeplake"):
        try:
            rows = _rows(make_deeplake())
            if kind == "auto":
                why = "a Deep Lake dataset is there"
            return Where("deeplake", normalize_url(url), why, network, make_deeplake), rows
        except DatasetNotFoundError:
            if kind == "deeplake" or not files_ok or version or query:
                raise
            why = "no Deep Lake dataset there (deeplake open: not found), so the files under the prefix"
    rows = _rows(make_files())
    return Where("files", url.rstrip("/"), why, network, make_files), rows


def mix_of(
    main: Where, others: Sequence[tuple[Where, float]], weight: float, epoch_rows: int | None
) -> tuple[Where, int]:
    """``main`` and ``others`` (each with its weight) as one ``MixedSource``, named by their URLs, and its
    rows per epoch; opened once here, so a mismatch of columns fails before anything is timed."""
    from ..sources.mixed import MixedSource

    wheres = [main, *(w for w, _ in others)]
    urls = [w.url for w in wheres]
    if len(set(urls)) != len(urls):
        raise ConfigError(f"--mix names {urls}: each dataset once")
    names: list[str] = []  # each dataset by the last part of its URL (its place after it, where two agree)
    for k, url in enumerate(urls):
        name = url.rstrip("/").rsplit("/", 1)[-1] or url
        names.append(name if name not in names else f"{name}.{k}")
    weights = dict(zip(names, [weight, *(x for _, x in others)], strict=True))

    def make() -> Any:
        return MixedSource({n: w.make() for n, w in zip(names, wheres, strict=True)}, weights, epoch_rows)

    why = f"a mixture, weights {weights}"
    return Where("mixed", make().url, why, main.network, make), _rows(make())


def _rows(source: Any) -> int:
    """Open ``source`` (its named errors: missing dataset, column, bucket), count its rows, close it."""
    try:
        return len(source.open())
    finally:
        source.close()


class AsyncRun:
    """asyncload as a training loop runs it: one ``AsyncLoader`` on a new source, made and opened (and
    its reader started) inside the first epoch's timing, then ``set_epoch(e)`` and an epoch each."""

    def __init__(self, make: Callable[[], Any], settings: Mapping[str, Any]) -> None:
        self.make, self.settings = make, dict(settings)
        self.loader: Any = None
        self.closed = False

    def epoch(self, e: int, last: bool) -> Iterator[Any]:
        """Epoch ``e`` (the first makes the loader: inside the timing); the last closes the loader, its
        reader process joined, so that its CPU is counted with that epoch's."""
        from ..loader import AsyncLoader

        if self.loader is None:
            self.loader = AsyncLoader(self.make(), **self.settings)
        try:
            self.loader.set_epoch(e)
            yield from self.loader
        finally:
            if last:
                self.close()

    def close(self) -> None:
        if self.loader is not None and not self.closed:
            self.closed = True
            self.loader.close()


@dataclass
class Runs:
    """The runs of one reader (of one kind of epoch): every measurement, and the figures over them."""

    name: str
    runs: list[Measurement] = field(default_factory=list)
    extras: list[dict[str, Any]] = field(default_factory=list)  # per run: its run and epoch, state, store figures

    def add(self, m: Measurement, extra: Mapping[str, Any]) -> None:
        self.runs.append(m)
        self.extras.append(dict(extra))

    def state(self) -> str:
        """The runs' state, ``cold`` or ``warm`` (``partly warm``), or ``mixed`` where they differ."""
        states = {x["state"] for x in self.extras}
        return states.pop() if len(states) == 1 else "mixed"

    def epoch_rates(self) -> list[float]:
        return [m.samples / m.seconds if m.seconds > 0 else 0.0 for m in self.runs]

    def steady_rates(self) -> list[float]:
        return [m.steady_samples / m.steady_seconds if m.steady_seconds > 0 else float("nan") for m in self.runs]

    def stages(self) -> dict[str, float] | None:
        """asyncload's CPU a sample by stage (``measure.cpu_stages``), the median of each over the runs; the
        memory sampler apart. None for a reader that counts no decode (the baseline)."""
        each = []
        for m, x in zip(self.runs, self.extras, strict=True):
            if x.get("cpu_decode_s") is None or not m.samples:
                continue
            parts = cpu_stages(
                m.cpu_seconds, max(m.cpu_seconds - m.own_cpu_seconds, 0.0), x["cpu_decode_s"],
                x.get("cpu_collate_s") or 0.0, m.consumer_cpu_seconds, m.sampler_cpu_seconds,
            )  # fmt: skip
            each.append({k: 1e3 * v / m.samples for k, v in {**parts, "memory sampler": m.sampler_cpu_seconds}.items()})
        return {k: statistics.median(e[k] for e in each) for k in each[0]} if each else None

    def summary(self) -> dict[str, Any]:
        ep, st = self.epoch_rates(), [r for r in self.steady_rates() if r == r]
        cpu = [m.cpu_per_sample_ms for m in self.runs]
        fetched = [x["remote_bytes"] for x in self.extras if x.get("remote_bytes") is not None]
        return {
            "name": self.name,
            "runs": len(self.runs),
            "samples": self.runs[0].samples if self.runs else 0,
            "state": self.state(),
            "epoch_samples_per_s": statistics.median(ep) if ep else 0.0,
            "epoch_samples_per_s_range": [min(ep), max(ep)] if ep else [0.0, 0.0],
            "steady_samples_per_s": statistics.median(st) if st else None,
            "first_batch_s": statistics.median(
                [m.first_batch_s for m in self.runs if m.first_batch_s is not None] or [0]
            ),
            "epoch_s": statistics.median([m.seconds for m in self.runs]) if self.runs else 0.0,
            "cpu_ms_per_sample": statistics.median(cpu) if cpu else 0.0,
            "peak_rss_mb": max(m.peak_rss_mb for m in self.runs) if self.runs else 0.0,
            "remote_bytes": statistics.median(fetched) if fetched else None,
            "cpu_ms_per_sample_by_stage": self.stages(),
            "each": [
                m.as_dict() | x | {"epoch_samples_per_s": r} for m, x, r in zip(self.runs, self.extras, ep, strict=True)
            ],
        }


#: What each asyncload run's JSON carries from ``stats()`` of its epoch, where it read through the node
#: store: the bytes the read stage fetched from the source (none from the node store's disk), and the
#: store's rows.
RUN_STATS = ("remote_bytes", "node_hits", "node_misses", "node_not_kept", "node_read_bytes")

#: What every asyncload run's JSON carries from ``stats()`` of its epoch: what it waited on, why, and the
#: wait split by stage (``report.waited_on`` words it for a run without training).
VERDICT = (
    "waiting_on", "waiting_on_why", "consumer_wait_frac", "cpu_workers",
    *(f"wait_on_{k}_s" for k in ("store", "decode", "augment", "transform", "collate", "other")),
)  # fmt: skip


@dataclass(frozen=True)
class Store:
    """Where asyncload's runs keep the rows they fetch (the node block store, ``nodestore``).

    ``cold`` (the default): each run reads through a private, empty directory, removed after, so every
    run's first epoch fetches everything, as a user's first epoch on a new machine does. ``yours``: the
    directory the user named (``--cache-dir``, or ``--warm``: the loader's default), shared by the runs
    and kept. ``off``: ``cache=False``, no store."""

    mode: str = "cold"  # "cold", "yours" or "off"
    cache: bool | str = "auto"  # the loader's cache setting
    cache_dir: str | None = None  # "yours": the directory

    def describe(self, used: bool) -> str:
        """The one thing the report says about the store (``used``: whether asyncload reads through one,
        ``store_used``)."""
        if not used and self.mode == "off":
            return "none (--cache off): every epoch reads the source"
        if not used:
            return (
                "none: a local dataset is read from its files every epoch (cache='auto' keeps remote sources "
                "only; --cache on keeps this one too)"
            )
        if self.mode == "yours":
            return f"the node store at {self.cache_dir}, shared by the runs and kept: runs find what earlier ones left"
        return "a private, empty node store per run (removed after): every run's epoch 1 is cold"


def store_used(where: Where, store: Store) -> bool:
    """Whether asyncload's runs read through the node store: not with ``--cache off``; with ``--cache
    auto`` (the loader's default) only for a source that is not on this machine (``Source.local``)."""
    if store.mode == "off":
        return False
    return store.cache is True or not where.make().local


def state_of(stats: Mapping[str, Any] | None, epoch: int) -> str:
    """``cold``, ``warm`` or ``partly warm``. A run that read through the node store: by what the store
    served (no row from it: cold; every row: warm). Without a store (the baseline, ``cache=False``, a
    local dataset): epoch 1 is cold and later epochs warm (the source stays open, the OS's and Deep
    Lake's caches hold what they hold)."""
    if stats is not None and (stats.get("node_hits") or stats.get("node_misses")):
        if not stats["node_hits"]:
            return "cold"
        return "warm" if not stats["node_misses"] else "partly warm"
    return "cold" if epoch == 0 else "warm"


@dataclass
class Result:
    """Every run of a comparison, split by epoch: ``first`` (epoch 1 of each run), ``later`` (epochs 2..N)."""

    first: tuple[Runs | None, Runs]
    later: tuple[Runs | None, Runs] | None
    store: Store
    store_used: bool  # whether asyncload read through the node store (``store_used``)
    work: str = "decodes each row"  # what the baseline does to each sample (``Shaper.work``)


def compare(
    where: Where, columns: Sequence[str], settings: Mapping[str, Any], *, repeat: int, baseline_rows: int,
    baseline: bool = True, epochs: int = 1, store: Store | None = None,
) -> Result:  # fmt: skip
    """Run the baseline and asyncload ``repeat`` times each, alternating (baseline first), each run
    ``epochs`` epochs on one open dataset; asyncload's runs with the node store ``store`` says (default:
    a private, empty one per run, so each run's first epoch is cold)."""
    from .coldstore import cold_cache_dir
    from .measure import descendants

    store = store or Store()
    base_runs = [Runs("sync"), Runs("sync")] if baseline else None
    ours = [Runs("asyncload"), Runs("asyncload")]
    before = descendants()  # processes that are not this comparison's (a test's server): left out of CPU
    used = store_used(where, store)
    work = "decodes each row"
    for r in range(repeat):
        if base_runs is not None:
            run = SyncRun(where, columns, baseline_rows, settings)
            try:
                for e in range(epochs):
                    m = measure("sync", run.epoch(e), count=lambda _: 1, live_tree=before)
                    base_runs[min(e, 1)].add(m, {"run": r + 1, "epoch": e + 1, "state": state_of(None, e)})
                work = run.shaper.work if run.shaper is not None else work
            finally:
                run.close()
        with contextlib.ExitStack() as stack:
            s = dict(settings)
            if store.mode == "off":
                s["cache"] = False
            elif store.mode == "yours":
                s["cache"], s["cache_dir"] = store.cache, store.cache_dir
            else:
                s["cache"], s["cache_dir"] = store.cache, stack.enter_context(cold_cache_dir())
            arun = AsyncRun(where.make, s)
            stack.callback(arun.close)
            for e in range(epochs):
                m = measure("asyncload", arun.epoch(e, last=e == epochs - 1), live_tree=before)
                st = arun.loader.stats() if arun.loader is not None else {}
                extra = {
                    "run": r + 1, "epoch": e + 1, "state": state_of(st, e),
                    **{k: st.get(k) for k in (*VERDICT, "cpu_decode_s", "cpu_collate_s")},
                }  # fmt: skip
                # the node store's rows only where there is one; the bytes received where they are counted
                # without it too (an object store's GETs: ``stats()["remote_bytes"]``)
                counted = used or where.kind == "files"
                ours[min(e, 1)].add(
                    m,
                    extra | {k: st.get(k) if (used or (counted and k == "remote_bytes")) else None for k in RUN_STATS},
                )
            if arun.loader is not None:
                ours[0].name = ours[1].name = describe_loader(arun.loader, settings)
    if base_runs is not None:
        n = base_runs[0].runs[0].samples
        what = {"deeplake": "ds[i][col]", "mixed": "reads, one row at a time"}.get(
            where.kind, "GETs, one row at a time"
        )
        base_runs[0].name = base_runs[1].name = f"sequential {what} ({n} rows)"
    first = (base_runs[0] if base_runs else None, ours[0])
    later = (base_runs[1] if base_runs else None, ours[1]) if epochs > 1 else None
    return Result(first, later, store, used, work)


def describe_loader(loader: Any, settings: Mapping[str, Any]) -> str:
    """``asyncload column reads, concurrency auto`` and every setting given that changes what is read."""
    words = [f"asyncload {loader.read_mode} reads", f"concurrency {loader.options.concurrency}"]
    for key in ("decode", "processes", "augment", "ragged", "normalize", "layout", "dtype", "memory_budget",
                "cpu_workers", "max_concurrency", "prefetch", "on_error"):  # fmt: skip
        if key in settings:
            words.append(f"{key} {_short(settings[key])}")
    return ", ".join(words)


def _short(v: Any) -> str:
    """A setting in a report: augmentation ops by name and size (``[Resize(256), RandomHorizontalFlip(0.5)]``)."""
    if isinstance(v, (list, tuple)) and v and hasattr(v[0], "__dataclass_fields__"):
        words = []
        for op in v:
            arg = getattr(op, "size", getattr(op, "p", ""))
            if isinstance(arg, tuple):  # (h, w): 256 when square, else 224x320
                arg = arg[0] if arg[0] == arg[1] else f"{arg[0]}x{arg[1]}"
            extra = f", scale={op.scale[0]:g}-{op.scale[1]:g}" if hasattr(op, "scale") else ""
            extra += ", keep_aspect" if getattr(op, "keep_aspect", False) else ""
            words.append(f"{type(op).__name__}({arg}{extra})")
        return "[" + ", ".join(words) + "]"
    return str(v)


__all__ = [
    "NORMALIZE",
    "RUN_STATS",
    "VERDICT",
    "Result",
    "Runs",
    "Store",
    "Where",
    "choose_source",
    "compare",
    "store_used",
]
