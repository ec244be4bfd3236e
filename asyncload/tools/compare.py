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
- **What it cost**: CPU per sample over the whole process tree (this process and its reaped children:
  each loader is closed, its reader process joined, before the clock's CPU is read) and the peak RSS of
  the tree (sampled every 20 ms).
- **Where it ran**: local disk, or the endpoint read. The command emulates no latency: the figures are
  those of the network as it is.

In one process, one run after another: Deep Lake's process-wide caches may hold what an earlier run read,
so run ``--repeat 1`` in a fresh process for a first, cold figure (the first run of a repeat is one).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from .measure import Measurement, measure

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


def sequential_deeplake(make: Callable[[], Any], columns: Sequence[str], limit: int) -> Iterator[int]:
    """The synchronous baseline on Deep Lake: ``ds = open(...)``, then ``ds[i][col]`` for each row and
    column, one after another, each copied to an array. The open is inside (this is a generator)."""
    import numpy as np

    source = make()
    ds = source.handle()  # one open: its version and creds, the rows of its query (row_ids below)
    try:
        n = min(limit, len(source))
        for i in source.row_ids(list(range(n))):
            row = ds[i]
            for c in columns:
                np.array(row[c])
            yield 1
    finally:
        source.close()


def sequential_files(make: Callable[[], Any], limit: int) -> Iterator[int]:
    """The synchronous baseline on object-store files: the listing, then one row at a time (its columns'
    GETs and decodes), each row finished before the next is asked for."""
    source = make()
    loop = asyncio.new_event_loop()
    try:
        source.open()
        for i in range(min(limit, len(source))):
            loop.run_until_complete(source.read([i]))
            yield 1
    finally:
        source.close()  # asks this loop to close the source's session: let it
        left = asyncio.all_tasks(loop)
        if left:  # (gather of nothing makes its future on another loop: a mixture of Deep Lake leaves none)
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.close()


def asyncload_epoch(make: Callable[[], Any], settings: Mapping[str, Any], seen: list[Any]) -> Iterator[Any]:
    """One whole epoch of a new ``AsyncLoader`` on a new source: made, opened and (for Deep Lake) its
    reader started inside the timing; closed at the end, so the reader's CPU is counted."""
    from ..loader import AsyncLoader

    loader = AsyncLoader(make(), **settings)
    seen.append(loader)
    try:
        yield from loader
    finally:
        loader.close()


@dataclass
class Runs:
    """The runs of one reader: every measurement, and the figures over them."""

    name: str
    runs: list[Measurement] = field(default_factory=list)

    def epoch_rates(self) -> list[float]:
        return [m.samples / m.seconds if m.seconds > 0 else 0.0 for m in self.runs]

    def steady_rates(self) -> list[float]:
        return [m.steady_samples / m.steady_seconds if m.steady_seconds > 0 else float("nan") for m in self.runs]

    def summary(self) -> dict[str, Any]:
        ep, st = self.epoch_rates(), [r for r in self.steady_rates() if r == r]
        cpu = [m.cpu_per_sample_ms for m in self.runs]
        return {
            "name": self.name,
            "runs": len(self.runs),
            "samples": self.runs[0].samples if self.runs else 0,
            "epoch_samples_per_s": statistics.median(ep) if ep else 0.0,
            "epoch_samples_per_s_range": [min(ep), max(ep)] if ep else [0.0, 0.0],
            "steady_samples_per_s": statistics.median(st) if st else None,
            "first_batch_s": statistics.median(
                [m.first_batch_s for m in self.runs if m.first_batch_s is not None] or [0]
            ),
            "epoch_s": statistics.median([m.seconds for m in self.runs]) if self.runs else 0.0,
            "cpu_ms_per_sample": statistics.median(cpu) if cpu else 0.0,
            "peak_rss_mb": max(m.peak_rss_mb for m in self.runs) if self.runs else 0.0,
            "each": [m.as_dict() | {"epoch_samples_per_s": r} for m, r in zip(self.runs, ep, strict=True)],
        }


def compare(
    where: Where, columns: Sequence[str], settings: Mapping[str, Any], *, repeat: int, baseline_rows: int,
    baseline: bool = True,
) -> tuple[Runs | None, Runs]:  # fmt: skip
    """Run the baseline and asyncload ``repeat`` times each, alternating (baseline first)."""
    base = Runs("sync") if baseline else None
    ours = Runs("asyncload")
    for _ in range(repeat):
        if base is not None:
            it = (
                sequential_deeplake(where.make, columns, baseline_rows)
                if where.kind == "deeplake"
                else sequential_files(where.make, baseline_rows)  # files, or a mixture's rows: read([i]) each
            )
            base.runs.append(measure("sync", it, count=lambda _: 1))
        loaders: list[Any] = []
        ours.runs.append(measure("asyncload", asyncload_epoch(where.make, settings, loaders)))
        if loaders:
            ours.name = describe_loader(loaders[0], settings)
    if base is not None:
        n = base.runs[0].samples
        what = {"deeplake": "ds[i][col]", "mixed": "reads, one row at a time"}.get(
            where.kind, "GETs, one row at a time"
        )
        base.name = f"sequential {what} ({n} rows)"
    return base, ours


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


def machine() -> dict[str, Any]:
    """The CPUs this process may use and the load average (taken before the runs, by ``asyncload load``):
    figures taken while other jobs share the cores are lower, and the report says so."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpus": cpus, "load_average_1min": load}


def report(
    where: Where, columns: Sequence[str], rows: int, base: Runs | None, ours: Runs, settings: Mapping[str, Any],
    repeat: int, host: Mapping[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Everything ``--json`` prints; the table is made from it."""
    doc: dict[str, Any] = {
        "url": where.url,
        "source": {"deeplake": "DeepLakeSource", "mixed": "MixedSource"}.get(where.kind, "ObjectStoreSource"),
        "source_chosen_because": where.why,
        "rows": rows,
        "columns": list(columns),
        "network": where.network,
        "latency_emulated": False,
        "repeat": repeat,
        "machine": dict(host) if host is not None else machine(),
        "settings": {k: _short(v) for k, v in settings.items()},
        "readers": [r.summary() for r in (base, ours) if r is not None],
    }
    if base is not None:
        b, a = doc["readers"]
        doc["speedup_epoch"] = a["epoch_samples_per_s"] / b["epoch_samples_per_s"] if b["epoch_samples_per_s"] else None
    return doc


def table(doc: Mapping[str, Any]) -> str:
    """The human report: what was read, where, how, and one row per reader."""
    out = [
        f"{doc['rows']} rows, columns {tuple(doc['columns'])}, from {doc['url']}",
        f"source: {doc['source']} ({doc['source_chosen_because']})",
        f"network: {doc['network']}; asyncload load emulates no latency",
        f"machine: {doc['machine']['cpus']} CPUs, load average {doc['machine']['load_average_1min']:.1f} "
        "before the runs (1 min)"
        if doc["machine"]["load_average_1min"] is not None
        else f"machine: {doc['machine']['cpus']} CPUs",
        f"each figure: median of {doc['repeat']} run(s), alternating; epoch = opening the dataset to the last "
        "sample; steady = first batch to last; CPU and peak RSS of the whole process tree",
        "",
        "| reader | samples | epoch samples/s (open included) | range | × sync | steady samples/s | first batch s "
        "| CPU ms/sample | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = doc["readers"][0]["epoch_samples_per_s"] if len(doc["readers"]) == 2 else None
    for r in doc["readers"]:
        lo, hi = r["epoch_samples_per_s_range"]
        ratio = f"{r['epoch_samples_per_s'] / base:.2f}" if base else "-"
        steady = f"{r['steady_samples_per_s']:,.0f}" if r["steady_samples_per_s"] is not None else "-"
        out.append(
            f"| {r['name']} | {r['samples']} | {r['epoch_samples_per_s']:,.0f} | {lo:,.0f}–{hi:,.0f} | {ratio} "
            f"| {steady} | {r['first_batch_s']:.2f} | {r['cpu_ms_per_sample']:.2f} | {r['peak_rss_mb']:,.0f} |"
        )
    return "\n".join(out)


def print_report(doc: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(doc, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print("\n" + table(doc))


__all__ = ["NORMALIZE", "Runs", "Where", "choose_source", "compare", "report", "table"]
