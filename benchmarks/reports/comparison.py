"""Render a comparison run (``results.json`` of ``suites/wan.py`` or ``suites/augment.py``) as ``table.md``,
plus ``throughput_vs_latency.png`` where a section sweeps latency.

    python benchmarks/reports/comparison.py benchmarks/results/wan

Each figure is the median repetition (by samples/s) of its reader, place and order. Ratios compare
readers measured in the same section, place and order of the same run, against the config's
``baseline`` reader: absolute figures on a shared 2-core machine move by ±30% between runs.
samples/s is a whole first epoch from opening the dataset to its last sample (``run_samples_per_s``).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

SPS = "run_samples_per_s"
Key = tuple[int, int | None, str, str]  # section, place (ms; None: local disk), order, reader


def medians(rows: list[dict[str, Any]], sections: list[dict[str, Any]] | None = None) -> dict[Key, dict[str, Any]]:
    """The median repetition of each (section, place, order, reader); failed runs are left out. With
    ``sections``, a reader that reads in an order of its own (a plain reader given asyncload's block order,
    ``order: blocks:B:W``, which its name says) is filed under its section's shuffled order (else its first),
    to be compared with the readers there rather than left out of every table."""
    runs: dict[Key, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        if r["loader"] != "netcheck" and SPS in r["m"]:
            order = r["order"]
            known = sections[r["section"]]["orders"] if sections is not None else [order]
            if order not in known:
                order = "shuffled" if "shuffled" in known else known[0]
            runs[(r["section"], r["latency_ms"], order, r["loader"])].append(r["m"])
    out = {}
    for key, ms in runs.items():
        ms.sort(key=lambda m: m[SPS])
        loads = [m["load_1min"] for m in ms if "load_1min" in m]
        out[key] = {**ms[len(ms) // 2], "runs": len(ms), "all_sps": [round(m[SPS], 1) for m in ms], "loads": loads}
    return out


def _runs(m: dict[str, Any]) -> str:
    """The repetitions' samples/s, and the machine's load at their ends where it was recorded."""
    loads = f"; load {min(m['loads']):.1f}–{max(m['loads']):.1f}" if m.get("loads") else ""
    return f"{m['runs']} ({', '.join(map(str, m['all_sps']))}{loads})"


def errors(rows: list[dict[str, Any]]) -> list[str]:
    return [
        f"- {r['loader']}, {r['dataset']}, {_where(r['latency_ms'])}, {r['order']}, run {r['rep'] + 1}: {r['m']['error']}"
        for r in rows
        if r["loader"] != "netcheck" and "error" in r["m"]
    ]


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:,.0f}"


def _x(v: float | None, ref: float | None) -> str:
    return "-" if v is None or not ref else f"{v / ref:.2f}×"


def _where(place: int | None) -> str:
    return "local disk" if place is None else f"{place} ms RTT"


def _network(data: dict[str, Any]) -> list[str]:
    net = data["network"]
    line = f"**Emulation: {net['emulation']}** — {net['how']}"
    if net.get("tcp_congestion_control"):
        line += f" (congestion control {net['tcp_congestion_control']})"
    if net.get("why_not_packet_level"):
        line += f"; fallback because: {net['why_not_packet_level']}"
    line += f"; bandwidth cap {net['rate_mbit']} Mbit/s." if net.get("rate_mbit") else "; no bandwidth cap."
    out = [line]
    if data.get("cores"):
        out.append(f"**Cores: {data['cores']}.**")
    checks = [r for r in data["rows"] if r["loader"] == "netcheck" and "small_get_s" in r["m"]]
    if checks:
        out += [
            "",
            "Path check (one client, plain http.client): "
            + "; ".join(
                f"{r['latency_ms']} ms set: small GET {r['m']['small_get_s'] * 1e3:.1f} ms, handshake "
                f"{r['m']['handshake_s'] * 1e3:.1f} ms, 8 MiB GET {r['m']['growth']['seconds']:.2f} s"
                for r in checks
            )
            + ".",
        ]
    return out


def _busy(m: dict[str, Any]) -> str:
    busy = m.get("server_cores_busy")
    return "- | " if busy is None else f"{100 * busy:.0f}% | "


def _table(
    med: dict[Key, dict[str, Any]], key: tuple[int, int | None, str], readers: list[str], base: str, rows: int
) -> list[str]:
    si, place, order = key
    ref = med.get((si, place, order, base))
    # the server side's cores (pinned testbed): near 100%, the server paced every reader of the row
    metered = any(m.get("server_cores_busy") is not None for k, m in med.items() if k[:3] == key)
    out = [
        f"| reader | samples/s | × {base} | client CPU ms/sample | × | peak RSS MB | × | first batch s | "
        f"KB received/sample | TCP connections | {'server core busy | ' if metered else ''}runs (samples/s each) |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if metered else ""),
    ]
    for name in readers:
        m = med.get((si, place, order, name))
        if m is None:
            continue
        part = "" if m.get("epoch_complete") else f" ({m['samples']:,} of {rows:,} rows)"
        bold = f"**{name}**" if name.startswith("asyncload") else name
        out.append(
            f"| {bold} | {_f(m[SPS])}{part} | {_x(m[SPS], ref and ref[SPS])} | {m['cpu_ms_per_sample']:.2f} | "
            f"{_x(m['cpu_ms_per_sample'], ref and ref['cpu_ms_per_sample'])} | {m['peak_rss_mb']:,.0f} | "
            f"{_x(m['peak_rss_mb'], ref and ref['peak_rss_mb'])} | {_f(m.get('first_batch_s'), 2)} | "
            f"{'-' if place is None else _f(m.get('rx_bytes_per_sample', 0) / 1e3)} | "
            f"{'-' if place is None else _f(m.get('tcp_opens'))} | {_busy(m) if metered else ''}{_runs(m)} |"
        )
    return out


def _stages(med: dict[Key, dict[str, Any]], key: tuple[int, int | None, str], readers: list[str]) -> list[str]:
    """asyncload's client CPU per sample by stage (``peers.harness.stages``), and every reader's by thread."""
    si, place, order = key
    ours = [
        (n, med[(si, place, order, n)])
        for n in readers
        if "stage_cpu_ms_per_sample" in med.get((si, place, order, n), {})
    ]
    if not ours:
        return []
    out = [
        "",
        "asyncload's client CPU ms/sample by stage: decode (decode, crop, resize, flip) and collate (collation "
        "and a `transform=` callable) are the thread CPU its `loader.stats()` counts, consumer the training "
        "thread, reader processes the CPU of its child processes (an isolated reader's start-up, Deep Lake reads and "
        "answers; fan-out workers), fetch the rest of the training process (event loop, Deep Lake's storage "
        "threads or the thread receiving a reader's answers, HTTP); bytes held: "
        "the peak of read and decoded bytes the pipeline held against its `memory_budget`.",
        "",
        "| reader | reader processes | fetch | decode | collate | consumer | total | bytes held peak MB / budget MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, m in ours:
        st = m["stage_cpu_ms_per_sample"]
        out.append(
            f"| {name} | {_f(st.get('children'), 2)} | {st['fetch']:.2f} | {st['decode']:.2f} | {st['collate']:.2f} | {st['consumer']:.2f} | "
            f"{m['cpu_ms_per_sample']:.2f} | {_mb(m.get('asyncload_bytes_held_peak'))} / {_mb(m.get('asyncload_memory_budget'))} |"
        )
    return out


def _walls(med: dict[Key, dict[str, Any]], key: tuple[int, int | None, str], readers: list[str]) -> list[str]:
    """Where each reader's time went (``peers.harness.WALL_STATS``), for the readers that report it."""
    si, place, order = key
    rows = [(n, med[(si, place, order, n)]) for n in readers if "stage_wall_s" in med.get((si, place, order, n), {})]
    if not rows:
        return []
    out = [
        "",
        "Where the time goes (wall seconds of the median run): open, the reader process's start (imports), the first "
        "answer of the store and the first batch from the reader's creation; requests and their wait summed over "
        "requests (they overlap), with the mean per request; decode, store write (the node block store), collate "
        "and queue (batches ready, waiting for the consumer) summed over batches.",
        "",
        "| reader | open | reader start | first answer | first batch | requests | request wait (mean ms) | MB fetched "
        "| decode | store write | collate | queue | whole run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in rows:
        w = m["stage_wall_s"]
        reqs = w.get("requests")
        mean = f" ({w['read_s'] / reqs * 1e3:.0f})" if reqs and w.get("read_s") is not None else ""
        mb = _f(w["remote_bytes"] / 1e6, 1) if w.get("remote_bytes") else "-"
        out.append(
            f"| {name} | {_f(w.get('open_s'), 2)} | {_f(w.get('reader_start_s'), 2)} | {_f(w.get('first_read_at_s'), 2)} "
            f"| {_f(m.get('first_batch_s'), 2)} | {_f(reqs)} | {_f(w.get('read_s'), 1)}{mean} | {mb} "
            f"| {_f(w.get('decode_s'), 2)} | {_f(w.get('store_write_s'), 2)} | {_f(w.get('collate_s'), 2)} "
            f"| {_f(w.get('queue_s'), 2)} | {_f(m.get('seconds'), 2)} |"
        )
    return out


def _threads(med: dict[Key, dict[str, Any]], key: tuple[int, int | None, str], readers: list[str]) -> list[str]:
    si, place, order = key
    out = [
        "",
        "<details><summary>client CPU ms/sample by thread group (live threads at the end of the run)</summary>",
        "",
    ]
    for name in readers:
        m = med.get((si, place, order, name))
        if m and m.get("thread_cpu_ms_per_sample"):
            top = sorted(m["thread_cpu_ms_per_sample"].items(), key=lambda kv: -kv[1])[:8]
            out.append(f"- {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in top if v >= 0.01))
    return out + ["", "</details>"]


def _sweep(med: dict[Key, dict[str, Any]], si: int, section: dict[str, Any], order: str) -> list[str]:
    lats = list(section["latencies_ms"])
    out = [
        "",
        f"samples/s by round-trip time, {order}:",
        "",
        "| reader | " + " | ".join(f"{x} ms" for x in lats) + " |",
    ]
    out.append("|---|" + "---|" * len(lats))
    for name in section["readers"]:
        out.append(f"| {name} | " + " | ".join(_f((med.get((si, x, order, name)) or {}).get(SPS)) for x in lats) + " |")
    return out


def tables(data: dict[str, Any]) -> str:
    med = medians(data["rows"], data["sections"])
    base = data.get("baseline") or ""
    out = [f"# {data['title']}: {data['date']}", "", f"Machine: {data['machine']}. Server: {data['server']}.", ""]
    out += _network(data)
    out += [
        "",
        f"Method: {data['method']}." + (f" Whole run {data['wall_s'] / 60:.1f} min." if data.get("wall_s") else ""),
    ]
    out += ["", "Datasets:"]
    for name, d in data["datasets"].items():
        b = d["bytes_per_sample"]
        out.append(
            f"- `{name}`: {d['describe']}; {b['total'] / 1e3:,.1f} KB per sample stored "
            f"(image {b['images'] / 1e3:,.1f} KB, mask {b['masks'] / 1e3:,.1f} KB)"
        )
    out += ["", "Readers:"]
    for name, r in data["readers"].items():
        extra = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        workers = f", {r['workers']} workers" if r["reader"] in ("sync", "pytorch") else ""
        out.append(f"- {name}: `peers` reader `{r['reader']}`{workers}" + (f"; options {extra}" if extra else ""))
    for si, s in enumerate(data["sections"]):
        rows = data["config"]["datasets"][s["dataset"]]["rows"]
        out += ["", f"## {s['title'] or s['dataset']}"]
        for place in [*s["latencies_ms"], *([None] if s["local"] else [])]:
            readers = list(s["local_readers"] or s["readers"]) if place is None else list(s["readers"])
            for order in s["orders"]:
                if not any((si, place, order, n) in med for n in readers):
                    continue
                out += ["", f"### {_where(place)}, {order}", ""]
                out += _table(med, (si, place, order), readers, base, rows)
                out += _stages(med, (si, place, order), readers)
                out += _walls(med, (si, place, order), readers)
                out += _threads(med, (si, place, order), readers)
        if len(s["latencies_ms"]) > 1:
            for order in s["orders"]:
                out += _sweep(med, si, s, order)
    errs = errors(data["rows"])
    if errs:
        out += ["", "## Failed runs", "", *errs]
    return "\n".join(out) + "\n"


def plot(data: dict[str, Any], out: Path) -> None:
    """samples/s against RTT for each section that sweeps latency (none: no plot)."""
    sweeps = [(si, s) for si, s in enumerate(data["sections"]) if len(s["latencies_ms"]) > 1]
    if not sweeps:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = medians(data["rows"])
    fig, axes = plt.subplots(1, len(sweeps), figsize=(7 * len(sweeps), 5), squeeze=False)
    for ax, (si, s) in zip(axes[0], sweeps, strict=True):
        order = s["orders"][-1]
        for name in s["readers"]:
            pts = [(x, med[(si, x, order, name)][SPS]) for x in s["latencies_ms"] if (si, x, order, name) in med]
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                label=name,
                lw=2.5 if name.startswith("asyncload") else 1.2,
            )
        ax.set(
            yscale="log",
            xlabel="round-trip time (ms)",
            ylabel="samples/s, first epoch open to last",
            title=f"{s['title']}, {order}",
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"emulation: {data['network']['emulation']}")
    fig.tight_layout()
    fig.savefig(out / "throughput_vs_latency.png", dpi=110)
    plt.close(fig)


def render(out: str | Path) -> None:
    """``results.json`` in ``out`` → ``table.md`` (and the plot)."""
    out = Path(out)
    data = json.loads((out / "results.json").read_text())
    (out / "table.md").write_text(tables(data))
    plot(data, out)


if __name__ == "__main__":
    render(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/wan")
