"""Render a WAN run (``results.json`` from ``wan.py``) as ``table.md`` and ``throughput_vs_latency.png``.

    python benchmarks/wan_report.py benchmarks/results/wan

Each figure is the median repetition (by samples/s) of its reader, latency and order; ratios compare
readers measured in the same run, since absolute figures on a shared 2-core machine move by ±30%.

samples/s is a whole first epoch from open to its last sample (``run_samples_per_s``): nothing a reader
banks before a window or leaves after it can move it. The first-batch-to-last figure is shown beside it;
it credits a reader for a late first batch (whatever it read meanwhile counts, the wait does not).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

DEFAULTS = "asyncload, defaults"
SPS = "run_samples_per_s"  # the figure every table, ratio and target uses (see the module docstring)
Key = tuple[str, int, str]  # loader, latency, order


def medians(rows: list[dict[str, Any]]) -> dict[Key, dict[str, Any]]:
    """The median repetition of each (loader, latency, order); failed runs are left out."""
    runs: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["loader"] != "netcheck" and SPS in r["m"]:
            runs[(r["loader"], r["latency_ms"], r["order"])].append(r["m"])
    out = {}
    for key, ms in runs.items():
        ms.sort(key=lambda m: m[SPS])
        out[key] = {**ms[len(ms) // 2], "runs": len(ms), "all_sps": [round(m[SPS], 1) for m in ms]}
    return out


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _kb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e3:,.0f}"


def _loaders(med: dict[Key, dict[str, Any]], variants: bool) -> list[str]:
    seen: dict[str, None] = {}
    for loader, _, _ in med:
        if loader.startswith("asyncload, ") and loader != DEFAULTS:
            if variants:
                seen[loader] = None
        elif not variants:
            seen[loader] = None
    return list(seen)


def _sps(med: dict[Key, dict[str, Any]], loader: str, lat: int, order: str) -> float | None:
    m = med.get((loader, lat, order))
    return m[SPS] if m else None


def _network(data: dict[str, Any]) -> list[str]:
    net = data["network"]
    out = [
        f"**emulation: {net['emulation']}** — {net['how']}"
        + (f" (congestion control {net.get('tcp_congestion_control')})" if net.get("tcp_congestion_control") else "")
        + (f"; fallback because: {net['why_not_packet_level']}" if net.get("why_not_packet_level") else "")
        + (f"; bandwidth cap {net['rate_mbit']} Mbit/s" if net.get("rate_mbit") else "; no bandwidth cap"),
        "",
        "## Path check (one client, plain http.client)",
        "",
        "| RTT set ms | small GET ms | handshake ms | connect ms | 8 MiB GET on a fresh connection: KB received by the end of RTT 1, 2, 3, ... 8 | 8 MiB GET s |",
        "|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if r["loader"] == "netcheck" and "small_get_s" in r["m"]:
            m = r["m"]
            growth = (
                ", ".join(f"{b / 1e3:,.0f}" for b in m["growth"]["bytes_by_rtt"])
                if r["latency_ms"]
                else "- (no RTT to count in)"
            )
            out.append(
                f"| {r['latency_ms']} | {m['small_get_s'] * 1e3:.1f} | {m['handshake_s'] * 1e3:.1f} | {m['connect_s'] * 1e3:.1f} | {growth} | {m['growth']['seconds']:.2f} |"
            )
    return out


def _focus(med: dict[Key, dict[str, Any]], lat: int, order: str, loaders: list[str], rows: int) -> list[str]:
    ours = med.get((DEFAULTS, lat, order))
    out = [
        f"### {lat} ms RTT, {order} order",
        "",
        "| reader | samples/s (epoch, open to last) | samples/s, first batch to last | first batch s | CPU ms/sample | peak RSS MB | asyncload defaults ÷ reader (samples/s) | TCP connections opened | KB received per sample | storage pool | runs (samples/s each) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for loader in loaders:
        m = med.get((loader, lat, order))
        if m is None:
            continue
        ratio = ours[SPS] / m[SPS] if ours and m[SPS] else None
        name = f"**{loader}**" if loader == DEFAULTS else loader
        out.append(
            f"| {name} | {_f(m[SPS])}{'' if m.get('epoch_complete') else ' (' + str(m['samples']) + ' of ' + str(rows) + ' rows)'} "
            f"| {_f(m.get('samples_per_s'))} | {_f(m.get('first_batch_s'), 2)} | {m['cpu_ms_per_sample']:.2f} | {m['peak_rss_mb']:,.0f} | {_f(ratio, 2)}× "
            f"| {_f(m.get('tcp_opens'))} | {_kb(m.get('rx_bytes_per_sample'))} | {_f(m.get('storage_threads'))} | {m['runs']} ({', '.join(map(str, m['all_sps']))}) |"
        )
    return out + [""]


def _targets(med: dict[Key, dict[str, Any]], lat: int, order: str) -> list[str]:
    """The issue's targets at the focus latency, as ratios within this run."""

    def get(name: str) -> dict[str, Any] | None:
        return med.get((name, lat, order))

    ours, ceil = get(DEFAULTS), get("plain column reader on a local copy (ceiling)")
    col, spdl = (
        get("plain column get_async (64 × 4 in flight, pool 64)"),
        get("SPDL 0.8 pipeline, per-row get_async, 64"),
    )
    sync0 = get("sync Dataset + DataLoader, 0 workers")
    if ours is None:
        return ["- asyncload defaults: not measured"]
    checks: list[tuple[str, float | None, str, bool]] = []
    for what, ref, want in (
        ("the local-copy ceiling", ceil, 0.75),
        ("SPDL", spdl, 2.0),
        ("the plain column reader", col, 1.2),
        ("sync, 0 workers", sync0, 40.0),
    ):
        r = ours[SPS] / ref[SPS] if ref else None
        checks.append((f"samples/s (epoch) vs {what}", r, f"≥ {want}×", r is not None and r >= want))
        if ref and ours.get("samples_per_s") and ref.get("samples_per_s"):
            r = ours["samples_per_s"] / ref["samples_per_s"]
            checks.append((f"samples/s first batch to last vs {what}", r, f"≥ {want}×", r >= want))
    cpu = ours["cpu_ms_per_sample"] / ceil["cpu_ms_per_sample"] if ceil and ceil["cpu_ms_per_sample"] else None
    checks.append(("CPU per sample vs the ceiling reader", cpu, "≤ 1.2×", cpu is not None and cpu <= 1.2))
    rss = ours["peak_rss_mb"] - col["peak_rss_mb"] if col else None
    checks.append(("peak RSS minus the plain reader's (MB)", rss, "≤ 100", rss is not None and rss <= 100))
    return [f"- {w}: {_f(v, 2)} (target {t}) {'met' if ok else 'MISSED'}" for w, v, t, ok in checks]


def tables(data: dict[str, Any]) -> str:
    med = medians(data["rows"])
    cfg = data["config"]
    lats, orders, focus = list(cfg["latencies_ms"]), list(cfg["orders"]), cfg["focus_ms"]
    bps = data["bytes_per_sample"]
    out = [
        f"# WAN benchmark {data['date']}",
        "",
        f"{data['machine']}; {data['dataset']}; **{bps['total'] / 1e3:,.0f} KB per sample** stored "
        f"(image {bps['images'] / 1e3:,.0f} KB, mask {bps['masks'] / 1e3:,.0f} KB); {data['server']}.",
        f"Method: {data['method']}." + (f" Whole run {data['wall_s'] / 60:.1f} min." if data.get("wall_s") else ""),
        "",
    ]
    out += _network(data)
    peers = _loaders(med, variants=False)
    for order in orders:
        out += [
            "",
            f"## samples/s by round-trip time, {order} order",
            "",
            "| reader | " + " | ".join(f"{x} ms" for x in lats) + " |",
            "|---|" + "---|" * len(lats),
        ]
        for loader in peers:
            out.append(f"| {loader} | " + " | ".join(_f(_sps(med, loader, x, order)) for x in lats) + " |")
    out += ["", f"## At {focus} ms", ""]
    for order in orders:
        out += _focus(med, focus, order, peers, cfg["rows"])
    out += [f"### Targets at {focus} ms, shuffled, defaults (issue 11)", ""] + _targets(med, focus, "shuffled")
    variants = _loaders(med, variants=True)
    if variants:
        out += ["", f"## Diagnosis: asyncload with options at {focus} ms (defaults untouched)", ""]
        for order in orders:
            out += _focus(
                med,
                focus,
                order,
                [DEFAULTS, *variants, "plain column get_async (64 × 4 in flight, pool 64)"],
                cfg["rows"],
            )
    return "\n".join(out) + "\n"


def plot(data: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = medians(data["rows"])
    orders = list(data["config"]["orders"])
    loaders = _loaders(med, variants=False)
    colour = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(loaders)}  # the same in every panel
    fig, axes = plt.subplots(1, len(orders), figsize=(7 * len(orders), 5.5), sharey=True, squeeze=False)
    for ax, order in zip(axes[0], orders, strict=True):
        for loader in loaders:
            pts = sorted((lat, m[SPS]) for (name, lat, o), m in med.items() if name == loader and o == order)
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=loader,
                color=colour[loader],
                linewidth=2.5 if loader == DEFAULTS else 1.2,
            )
        ax.set_yscale("log")
        ax.set_xlabel("round-trip time (ms)")
        ax.set_title(f"{order} order")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("samples/s, first epoch open to last (log)")
    axes[0][0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"First epoch, cold, photo-like PNG; emulation: {data['network']['emulation']}")
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_latency.png", dpi=110)
    plt.close(fig)


def render(out: str | Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import report

    report.render(out, tables, plot)


if __name__ == "__main__":
    render(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/wan")
