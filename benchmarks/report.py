"""Render a benchmark run (``results.json``) as markdown tables and PNG plots.

python benchmarks/report.py benchmarks/results/reference
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

FOCUS_MS = 50


def _by_latency_head(title: str, lats: list[Any]) -> list[str]:
    """A section title and the head of a table with one column per round-trip latency."""
    return [
        "",
        f"## {title}",
        "",
        "| loader | " + " | ".join(f"{x} ms" for x in lats) + " |",
        "|---|" + "---|" * len(lats),
    ]


def _sps(row: dict[str, Any]) -> float | None:
    v = row["m"].get("samples_per_s")
    return float(v) if v is not None else None


def _main_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r
        for r in rows
        if r["loader"] != "netcheck" and not r["settings"].get("sweep") and not r["loader"].startswith("train-step")
    ]


def _fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def tables(data: dict[str, Any]) -> str:
    rows = data["rows"]
    lats = sorted({r["latency_ms"] for r in rows if r["latency_ms"] is not None})
    out = [f"# Benchmark run {data['date']}", "", f"{data['machine']}; {data['dataset']}; {data['server']}.", ""]

    # Path check.
    out += [
        "## The emulated network",
        "",
        "| RTT set ms | small GET ms | handshake ms | 8 MiB GET MB/s |",
        "|---|---|---|---|",
    ]
    for r in rows:
        if r["loader"] == "netcheck":
            m = r["m"]
            out.append(
                f"| {r['latency_ms']} | {m['small_get_s'] * 1e3:.1f} | {m['handshake_s'] * 1e3:.1f} | {m['large_mb_s']:,.0f} |"
            )

    # Throughput by latency.
    by: dict[str, dict[int | None, dict[str, Any]]] = defaultdict(dict)
    for r in _main_rows(rows):
        by[r["loader"]][r["latency_ms"]] = r
    out += _by_latency_head("samples/s by round-trip latency", lats)
    for name, per in by.items():
        if None in per:
            out.append(f"| {name} | " + " | ".join(_fmt(_sps(per[None])) for _ in lats) + " |")
        else:
            out.append(f"| {name} | " + " | ".join(_fmt(_sps(per[x])) if x in per else "-" for x in lats) + " |")

    # The focus latency, with ratios and the targets.
    at = {name: per.get(FOCUS_MS, per.get(None)) for name, per in by.items()}
    base = next(
        (r for n, r in at.items() if n.startswith("sync Dataset") and r and r["settings"].get("workers") == 0), None
    )
    if base is not None and _sps(base):
        b = _sps(base) or 1.0
        out += [
            "",
            f"## At {FOCUS_MS} ms RTT",
            "",
            "| loader | samples/s | × sync, 0 workers | CPU ms/sample | peak RSS MB | RSS added MB | first batch s |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in at.items():
            if r is None or "error" in r["m"]:
                continue
            m = r["m"]
            out.append(
                f"| {name} | {_fmt(_sps(r))} | {(_sps(r) or 0) / b:.1f} | {m.get('cpu_per_sample_ms', 0):.2f} | "
                f"{m.get('peak_rss_mb', 0):,.0f} | {m.get('rss_growth_mb', 0):,.0f} | {_fmt(m.get('first_batch_s'), 2)} |"
            )
        out += ["", "### Targets at 50 ms", ""] + _targets(at, b)

    # Concurrency sweep.
    sweep = [r for r in rows if r["settings"].get("sweep")]
    if sweep:
        conc = sorted({r["settings"]["concurrency"] for r in sweep})
        for lat in sorted({r["latency_ms"] for r in sweep}):
            out += [
                "",
                f"## Concurrency sweep at {lat} ms (samples/s)",
                "",
                "| read mode | " + " | ".join(map(str, conc)) + " |",
                "|---|" + "---|" * len(conc),
            ]
            for mode in sorted({r["settings"]["read_mode"] for r in sweep}):
                cells = {
                    r["settings"]["concurrency"]: _sps(r)
                    for r in sweep
                    if r["latency_ms"] == lat and r["settings"]["read_mode"] == mode
                }
                out.append(f"| {mode} | " + " | ".join(_fmt(cells.get(c)) for c in conc) + " |")

    # Training-step simulation.
    sims = [r for r in rows if r["loader"].startswith("train-step")]
    if sims:
        names = sorted({r["loader"] for r in sims})
        out += _by_latency_head("Fraction of a 100 ms training step spent waiting for data", lats)
        for n in names:
            cells = {r["latency_ms"]: r["m"].get("data_wait_fraction") for r in sims if r["loader"] == n}
            out.append(
                f"| {n.removeprefix('train-step sim: ')} | "
                + " | ".join("-" if cells.get(x) is None else f"{cells[x]:.0%}" for x in lats)
                + " |"
            )
    return "\n".join(out) + "\n"


def _targets(at: dict[str, dict[str, Any] | None], base: float) -> list[str]:
    def find(prefix: str) -> float | None:
        for n, r in at.items():
            if n.startswith(prefix) and r is not None:
                return _sps(r)
        return None

    ours = find("asyncload, concurrency")
    lines = []
    checks = [
        ("its own local-disk ceiling", find("asyncload on local disk"), 0.8),
        ("the synchronous baseline, 0 workers", base, 20.0),
        ("ds.pytorch() with 4 workers", find("ds.pytorch() + DataLoader, 4 workers"), 3.0),
        ("the published recipe", find("published recipe"), 2.0),
    ]
    for what, ref, want in checks:
        if ours is None or not ref:
            lines.append(f"- vs {what}: not measured")
            continue
        ratio = ours / ref
        lines.append(f"- vs {what}: {ratio:.2f}× (target ≥ {want}×) {'met' if ratio >= want else 'MISSED'}")
    return lines


def plots(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["rows"]
    by: dict[str, list[tuple[int, float]]] = defaultdict(list)
    ceiling = None
    for r in _main_rows(rows):
        if r["latency_ms"] is None:
            ceiling = (r["loader"], _sps(r))
        elif _sps(r):
            by[r["loader"]].append((r["latency_ms"], _sps(r) or 0.0))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, pts in by.items():
        pts.sort()
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="o",
            label=name,
            linewidth=2.5 if name.startswith("asyncload") else 1.2,
        )
    if ceiling and ceiling[1]:
        ax.axhline(ceiling[1], color="grey", linestyle="--", label=ceiling[0])
    ax.set_yscale("log")
    ax.set_xlabel("added round-trip latency (ms)")
    ax.set_ylabel("samples/s (log)")
    ax.set_title("Throughput against network latency")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_latency.png", dpi=110)
    plt.close(fig)

    sweep = [r for r in rows if r["settings"].get("sweep")]
    if sweep:
        fig, ax = plt.subplots(figsize=(8, 5))
        for lat in sorted({r["latency_ms"] for r in sweep}):
            for mode in sorted({r["settings"]["read_mode"] for r in sweep}):
                pts = sorted(
                    (r["settings"]["concurrency"], _sps(r) or 0.0)
                    for r in sweep
                    if r["latency_ms"] == lat and r["settings"]["read_mode"] == mode
                )
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{mode} reads, {lat} ms")
            auto = [
                r
                for r in _main_rows(rows)
                if r["latency_ms"] == lat and r["loader"].startswith("asyncload, concurrency auto")
            ]
            if auto and _sps(auto[0]):
                ax.axhline(_sps(auto[0]), linestyle="--", color="black", label=f"concurrency='auto', {lat} ms")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (samples in flight)")
        ax.set_ylabel("samples/s")
        ax.set_title("asyncload throughput against concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "throughput_vs_concurrency.png", dpi=110)
        plt.close(fig)


def render(out: str | Path, tables: Any = tables, plots: Any = plots) -> None:
    """``results.json`` in ``out`` → ``table.md`` and the plots (``wan_report.py`` passes its own)."""
    out = Path(out)
    data = json.loads((out / "results.json").read_text())
    (out / "table.md").write_text(tables(data))
    plots(data, out)


if __name__ == "__main__":
    render(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/latest")
