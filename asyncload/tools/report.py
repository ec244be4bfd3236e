"""``asyncload load``'s report: the JSON document (``--json``) and the table made from it.

Why it says what it says, line by line:

- **One thing about the node store**, decided before the runs (``compare.store_used``), in the header and
  the table alike: a private, empty store per run, the user's store, or none (and why none).
- **Why asyncload is faster or slower on local disk**: there are no round trips to overlap there, so the
  comparison is of CPU and start-up; the report gives both figures and names the settings that move them
  (``why_local``), instead of leaving a bare 0.68x for the reader to explain.
- **What the loader waited on, not what training did**: ``asyncload load`` runs no training step, so the
  loop takes every batch at once and ``stats()["waiting_on"]`` can only name the loader's slowest stage;
  the line says that (``waited_on``), where a training verdict ("waited 98% of its time") would mislead.
- **Bytes named by what they count**: an object store's column is the bytes its GETs received as they
  crossed the wire; Deep Lake's is the stored bytes of the rows it handed over (its own chunk reads, which
  it does not report, pull more).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from .compare import Result, Runs, Where, _short

#: The wait split of ``stats()`` (``wait_on_<stage>_s``) and how each stage is named in a sentence.
STAGE_WORDS = {
    "store": "the reads",
    "decode": "decoding",
    "augment": "the augmentation",
    "transform": "the transform",
    "collate": "collation",
    "other": "the hand-over",
}
#: Networks on which there is no round trip for asyncload to overlap.
LOCAL = ("local disk", "memory (this process)")


def machine() -> dict[str, Any]:
    """The CPUs this process may use and the load average (taken before the runs, by ``asyncload load``):
    figures taken while other jobs share the cores are lower, and the report says so."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpus": cpus, "load_average_1min": load}


def _pair(base: Runs | None, ours: Runs) -> dict[str, Any]:
    """The readers' summaries and asyncload's speed-up over the baseline on the same kind of epoch."""
    out: dict[str, Any] = {"readers": [r.summary() for r in (base, ours) if r is not None]}
    if base is not None:
        b, a = out["readers"]
        out["speedup_epoch"] = a["epoch_samples_per_s"] / b["epoch_samples_per_s"] if b["epoch_samples_per_s"] else None
    return out


def bytes_column(kind: str) -> str:
    """The table's bytes column, named by what ``stats()["remote_bytes"]`` counts for this source."""
    return "MB received" if kind == "files" else "MB of rows fetched"


def report(
    where: Where, columns: Sequence[str], rows: int, result: Result, settings: Mapping[str, Any], repeat: int,
    host: Mapping[str, Any] | None = None, epochs: int = 1,
) -> dict[str, Any]:  # fmt: skip
    """Everything ``--json`` prints; the table is made from it. ``readers`` and ``speedup_epoch`` are of
    each run's first epoch; ``later_epochs`` (with ``--epochs`` 2 or more) the same of epochs 2..N; every
    run in ``each`` names its run, epoch and state, and asyncload's its ``remote_bytes``."""
    store = result.store
    doc: dict[str, Any] = {
        "url": where.url,
        "source": {"deeplake": "DeepLakeSource", "mixed": "MixedSource"}.get(where.kind, "ObjectStoreSource"),
        "source_chosen_because": where.why,
        "rows": rows,
        "columns": list(columns),
        "network": where.network,
        "latency_emulated": False,
        "repeat": repeat,
        "epochs": epochs,
        "baseline_work": result.work,
        "remote_bytes_counts": "the bytes the GETs received from the store, as they crossed the wire"
        if where.kind == "files"
        else "the stored bytes of the rows fetched from the source (Deep Lake does not report its own chunk reads)",
        "node_store": {
            "mode": store.mode if result.store_used else "not used",
            "cache_dir": store.cache_dir,
            "describe": store.describe(result.store_used),
        },
        "machine": dict(host) if host is not None else machine(),
        "settings": {k: _short(v) for k, v in settings.items()},
        **_pair(*result.first),
    }
    if result.later is not None:
        doc["later_epochs"] = {"epochs": f"2-{epochs}" if epochs > 2 else "2", **_pair(*result.later)}
    return doc


def _rows_of(readers: Sequence[Mapping[str, Any]], open_included: bool, fetched_head: str) -> list[str]:
    """One table: a row per reader, × sync against the first (the baseline) where there are two."""
    head = "epoch samples/s (open included)" if open_included else "epoch samples/s"
    out = [
        f"| reader | samples | {head} | range | × sync | steady samples/s | first batch s | CPU ms/sample "
        f"| peak RSS MB | state | {fetched_head} |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = readers[0]["epoch_samples_per_s"] if len(readers) == 2 else None
    for r in readers:
        lo, hi = r["epoch_samples_per_s_range"]
        ratio = f"{r['epoch_samples_per_s'] / base:.2f}" if base else "-"
        steady = f"{r['steady_samples_per_s']:,.0f}" if r["steady_samples_per_s"] is not None else "-"
        fetched = f"{r['remote_bytes'] / 1e6:,.1f}" if r.get("remote_bytes") is not None else "-"
        out.append(
            f"| {r['name']} | {r['samples']} | {r['epoch_samples_per_s']:,.0f} | {lo:,.0f}–{hi:,.0f} | {ratio} "
            f"| {steady} | {r['first_batch_s']:.2f} | {r['cpu_ms_per_sample']:.2f} | {r['peak_rss_mb']:,.0f} "
            f"| {r['state']} | {fetched} |"
        )
    return out


def table(doc: Mapping[str, Any]) -> str:
    """The human report: what was read, where, how; a table of the first epochs, one of the later ones."""
    epochs = doc.get("epochs", 1)
    kind = "files" if doc["source"] == "ObjectStoreSource" else "deeplake"
    head = bytes_column(kind)
    load = doc["machine"]["load_average_1min"]
    out = [
        f"{doc['rows']} rows, columns {tuple(doc['columns'])}, from {doc['url']}",
        f"source: {doc['source']} ({doc['source_chosen_because']})",
        f"network: {doc['network']}; asyncload load emulates no latency",
        f"machine: {doc['machine']['cpus']} CPUs"
        + (f", load average {load:.1f} before the runs (1 min)" if load is not None else ""),
        f"asyncload's node store: {doc['node_store']['describe']}",
        f"the baseline: one row after another; it {doc.get('baseline_work', 'decodes each row')}",
        f"each figure: median of {doc['repeat']} run(s), alternating, {epochs} epoch(s) each on one open dataset; "
        f"steady = first batch to last; CPU and peak RSS of the whole process tree; {head}: stats()['remote_bytes'], "
        f"{doc.get('remote_bytes_counts', '')}",
        "",
        "epoch 1 of each run (the dataset opened inside the timing):",
        "",
        *_rows_of(doc["readers"], True, head),
        *by_stage(doc["readers"]),
        *waited_on(doc["readers"]),
        *why_local(doc),
    ]
    if "later_epochs" in doc:
        later = doc["later_epochs"]
        ours = (
            "asyncload reads what epoch 1 left in its node store"
            if doc["node_store"]["mode"] in ("cold", "yours")
            else "asyncload reads the source again, no node store"
        )
        out += [
            "",
            f"epochs {later['epochs']} of each run (the same open dataset; warm: {ours}, the baseline what its "
            "own caches hold):",
            "",
            *_rows_of(later["readers"], False, head),
        ]
    return "\n".join(out)


def by_stage(readers: Sequence[Mapping[str, Any]]) -> list[str]:
    """asyncload's CPU ms a sample by stage, under the table (``compare.Runs.stages``)."""
    out = []
    for r in readers:
        st = r.get("cpu_ms_per_sample_by_stage")
        if st:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in st.items() if k != "memory sampler")
            out += [
                "",
                f"{r['name']}: CPU ms a sample by stage (median of the runs): {parts}; this report's memory "
                f"sampler {st['memory sampler']:.2f} of the {r['cpu_ms_per_sample']:.2f}",
            ]
    return out


def waited_on(readers: Sequence[Mapping[str, Any]]) -> list[str]:
    """What asyncload's loader waited on in its first epochs. No training ran: the loop asked for each
    batch as soon as it had the last, so ``waiting_on`` names the loader's slowest stage, and the line
    gives the wait's split by stage rather than a training verdict."""
    said = []
    for r in readers:
        for e in r.get("each", []):
            if not e.get("waiting_on"):
                continue
            waits = {k: e.get(f"wait_on_{k}_s") or 0.0 for k in STAGE_WORDS}
            total = sum(waits.values())
            if e["waiting_on"] == "training" or total <= 0.0:
                said.append(f"nothing: batches were ready when the loop asked ({e['waiting_on_why']})")
                continue
            split = sorted(((v / total, k) for k, v in waits.items() if v / total >= 0.05), reverse=True)
            said.append(
                f"{e['waiting_on']} (of the loop's wait for batches: "
                + ", ".join(f"{share:.0%} on {STAGE_WORDS[k]}" for share, k in split)
                + ")"
            )
    if not said:
        return []
    return [
        "",
        "what asyncload's loader waited on (no training ran: the loop took each batch at once, so this is the "
        "loader's slowest stage, not a training verdict): " + "; ".join(said),
    ]


def why_local(doc: Mapping[str, Any]) -> list[str]:
    """On a local dataset, why asyncload is faster or slower than the loop, and the settings that move it:
    no round trip there is for asyncload to overlap, so the difference is CPU per sample and start-up."""
    readers = doc["readers"]
    if doc["network"] not in LOCAL or len(readers) != 2:
        return []
    base, ours = readers
    faster = ours["epoch_samples_per_s"] >= base["epoch_samples_per_s"]
    threads = next((e.get("cpu_workers") for e in ours.get("each", []) if e.get("cpu_workers")), None)
    settings = doc.get("settings", {})
    reader = doc["source"] != "ObjectStoreSource" and str(settings.get("processes", "auto")) == "auto"
    epoch_s, first_s = ours["epoch_s"], ours["first_batch_s"]
    lines = [
        "",
        f"why asyncload is {'faster' if faster else 'slower'} here: on local disk there are no round trips for it "
        "to overlap, so the difference is CPU and start-up.",
        f"- CPU per sample: asyncload {ours['cpu_ms_per_sample']:.2f} ms, the loop {base['cpu_ms_per_sample']:.2f} ms"
        + (f"; asyncload decodes on {threads} threads at once, the loop on one" if threads else ""),
        f"- start: asyncload's first batch came {first_s:.2f} s into its {epoch_s:.2f} s epoch (opening the dataset"
        + (", starting its reader process" if reader else "")
        + f"), the loop's first row {base['first_batch_s']:.2f} s into its own",
    ]
    change = []
    if reader:
        change.append("--processes 0 (Deep Lake read in this process: no reader process to start, no copy of each "
                      "answer between processes; a native crash in Deep Lake then ends this process)")  # fmt: skip
    change.append(f"--cpu-workers N (decode threads; {threads or 'one per core'} now)")
    change.append("a longer epoch (the start is paid once per epoch)")
    change.append("a dataset on a remote store, where the loop waits for every round trip and asyncload overlaps them")
    lines.append("- what changes it: " + "; ".join(change))
    return lines


def print_report(doc: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        json.dump(doc, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
    else:
        print("\n" + table(doc))


__all__ = ["by_stage", "bytes_column", "machine", "print_report", "report", "table", "waited_on", "why_local"]
