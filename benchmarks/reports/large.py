"""The table of ``make bench-large-data``: what each reader pulls from the store for what it reads.

    python -m benchmarks.reports.large benchmarks/results/large

Per reader and place: samples/s over the run (open to last sample), the rows it read (a reader stopped
60 s after its first batch read fewer than the epoch), **bytes received on the client's interfaces ÷ the
stored bytes of the rows read**, CPU per sample and peak RSS of the process tree, the first batch, and
the disk cache's size at the end where one was on. × compares samples/s with the defaults on the same
dataset and place; "of small" compares the large dataset's defaults with the small one's in the same run
(the issue's target: ≥ 0.9×), and peak RSS with the small one's (target: ≤ +250 MB).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def _where(ms: int | None) -> str:
    return "local disk" if ms is None else f"{ms} ms"


def render(out: Path) -> str:
    doc = json.loads((out / "results.json").read_text())
    base = doc.get("baseline", "")
    stored = {n: d["bytes_per_sample"]["total"] for n, d in doc["datasets"].items()}
    rows = [r for r in doc["rows"] if r.get("loader") != "netcheck"]
    med: dict[tuple[str, Any, str], dict[str, Any]] = {}
    for r in rows:  # one repetition each here; the last wins if there are more
        if "error" not in r["m"]:
            med[(r["dataset"], r["latency_ms"], r["loader"])] = r["m"]
    lines = [
        f"# {doc.get('title', 'large dataset')}",
        "",
        f"{doc['date']}; {doc.get('machine', '')}; network: {_net(doc)}.",
        "",
    ]
    for name, d in doc["datasets"].items():
        lines.append(f"- `{name}`: {d['describe']}, {stored[name] / 1e3:.1f} KB stored a row")
    lines += [
        "",
        "| dataset | place | reader | samples/s | × defaults | rows read | bytes received ÷ stored | CPU ms/sample | peak RSS MB | first batch s | disk cache MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (ds, ms, reader), m in med.items():
        ref = med.get((ds, ms, base))
        ratio = m["run_samples_per_s"] / ref["run_samples_per_s"] if ref else None
        cache = f"{m['disk_cache_mb']:,.0f}" if m.get("disk_cache_mb") is not None else ""
        lines.append(
            f"| {ds} | {_where(ms)} | {reader} | {m['run_samples_per_s']:,.0f} | {_x(ratio)} | {m['samples']:,} | "
            f"{m['rx_bytes_per_sample'] / stored[ds]:.2f} | {m['cpu_ms_per_sample']:.2f} | {m['peak_rss_mb']:,.0f} | "
            f"{m['first_batch_s']:.2f} | {cache} |"
        )
    errors = [r for r in rows if "error" in r["m"]]
    if errors:
        lines += ["", "Failed runs:"] + [
            f"- {r['loader']}, {r['dataset']}, {_where(r['latency_ms'])}: {r['m']['error']}" for r in errors
        ]
    targets = []
    if {"small", "large"} <= set(doc["datasets"]):  # the config's names
        small, large = "small", "large"
        for ms in sorted({k[1] for k in med if k[1] is not None}) + ([None] if any(k[1] is None for k in med) else []):
            a, b = med.get((large, ms, base)), med.get((small, ms, base))
            if a and b:
                targets.append(
                    f"- {_where(ms)}: the large dataset's defaults read {a['run_samples_per_s'] / b['run_samples_per_s']:.2f}× "
                    f"the small one's samples/s, {a['rx_bytes_per_sample'] / stored[large]:.2f}× its stored bytes, "
                    f"peak RSS {a['peak_rss_mb'] - b['peak_rss_mb']:+,.0f} MB"
                )
    if targets:
        lines += [
            "",
            "The issue's targets (defaults, same run): ≥ 0.9× the small dataset's samples/s, ≤ 1.3× bytes, ≤ +250 MB:",
            *targets,
        ]
    text = "\n".join(lines) + "\n"
    (out / "table.md").write_text(text)
    return text


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}×"


def _net(doc: dict[str, Any]) -> str:
    net = doc.get("network", {})
    return str(net.get("kind") or net.get("describe") or net) if isinstance(net, dict) else str(net)


if __name__ == "__main__":
    print(render(Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/large")))
