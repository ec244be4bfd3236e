"""The node block store measured: epochs 1-3 from SeaweedFS behind packet-level latency, with 1, 2 and 4
readers, against the same data read from a local copy and without the store; and memory with large rows.

    python benchmarks/suites/nodestore.py [--rows 30000] [--rtts 0,50] [--out benchmarks/results/nodestore]

Each row of the tables is a fresh process (``peers.harness.Runner``, in the client's network namespace)
that opens the dataset and reads ``epochs`` whole shuffled epochs with a fresh, empty node store: per
epoch the seconds from its start (the first: from before the dataset is opened) to its last sample,
samples/s, the bytes the client namespace received (every process of the tree: DataLoader workers,
fan-out workers, reader processes) per stored byte, and the first batch; the peak RSS of the process tree
over the run. ``stored`` is the dataset's bytes on disk (Deep Lake's files).

Readers: ``loader`` (``AsyncLoader``, the defaults), ``dl2``/``dl4`` (``AsyncIterableDataset`` in a
``DataLoader`` of 2 / 4 persistent workers), ``procs4`` (``processes=4``), ``nostore`` (``cache=False``),
``local`` (the defaults on a local copy: the ceiling later epochs should reach).

The memory section reads a local dataset of large PNG rows (not kept: a local source) with the default
block order and with a full shuffle, at ``memory_budget`` 64 MB and the default, a slow consumer, and
reports the tree's peak RSS (resident anonymous + file-backed pages of every process: what ``ps`` shows).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def epochs(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: ``spec["epochs"]`` shuffled epochs; figures per epoch (module docstring)."""
    from torch.utils.data import DataLoader

    from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource
    from asyncload.tools.coldstore import dir_bytes, new_cold_dir
    from asyncload.tools.measure import PeakRSS
    from benchmarks.peers.harness import net_counters

    store = new_cold_dir()  # epoch 1 cold: a store of this run's own (the helper every suite uses)
    os.environ["ASYNCLOAD_CACHE_DIR"] = store
    rss = PeakRSS(every_s=0.1)
    out: list[dict[str, Any]] = []
    t0, net0 = time.perf_counter(), net_counters()
    src = DeepLakeSource(spec["url"], columns=("images", "masks"), creds=spec["creds"])
    opts = {"batch_size": 32, "shuffle": True, **spec["options"]}
    w = spec["workers"]
    if w:
        ds = AsyncIterableDataset(src, **opts)
        dl = DataLoader(
            ds, batch_size=None, num_workers=w, persistent_workers=True, multiprocessing_context="forkserver"
        )
        setter, it_of, stats = ds.set_epoch, (lambda: iter(dl)), (lambda: {})
    else:
        loader = AsyncLoader(src, **opts)
        setter, it_of, stats = loader.set_epoch, (lambda: iter(loader)), loader.stats
    try:
        for e in range(spec["epochs"]):
            if e:
                t0, net0 = time.perf_counter(), net_counters()
            setter(e)
            seen, first = 0, None
            for b in it_of():
                seen += len(b["index"])
                if first is None:
                    first = time.perf_counter() - t0
                if spec.get("consume_s"):
                    time.sleep(spec["consume_s"])
            dt = time.perf_counter() - t0
            net = net_counters()
            s = stats()
            out.append({
                "epoch": e + 1, "samples": seen, "seconds": round(dt, 2), "samples_per_s": round(seen / dt, 1),
                "rx_bytes": net["rx_bytes"] - net0["rx_bytes"], "first_batch_s": round(first or 0.0, 2),
                **{k: s[k] for k in ("node_hits", "node_misses", "bytes_held_peak") if k in s},
            })  # fmt: skip
    finally:
        if w:
            del dl
        else:
            loader.close()
        peak = rss.stop()
        store_mb = dir_bytes(store) / 1e6
        shutil.rmtree(store, ignore_errors=True)
    return {
        "epochs": out,
        "peak_rss_mb": round(peak, 1),
        "store_mb": round(store_mb, 1),
        "load_1min": os.getloadavg()[0],
    }


READERS: dict[str, dict[str, Any]] = {
    "loader": {"workers": 0, "options": {}},
    "dl2": {"workers": 2, "options": {}},
    "dl4": {"workers": 4, "options": {}},
    "procs4": {"workers": 0, "options": {"processes": 4}},
    "nostore": {"workers": 0, "options": {"cache": False}},
}


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def memory_main(a: argparse.Namespace) -> None:
    """The memory section: a local dataset of large PNG rows, the block order against a full shuffle."""
    from benchmarks.peers.harness import Runner
    from benchmarks.testbeds.world import DatasetSpec, local_dataset

    spec = DatasetSpec(rows=a.memory_rows, image_format="png", size=512, mask_format="png")
    path = local_dataset(spec, ROOT / "data" / "bench")
    run = Runner(a.timeout)
    rows = []
    for budget in (64 << 20, None):
        for block in ("auto", 64, 1):
            opts: dict[str, Any] = {"shuffle_block": block}
            if budget:
                opts["memory_budget"] = budget
            s = {"url": f"file://{path}", "creds": None, "workers": 0, "options": opts, "epochs": 1, "consume_s": 0.05}
            got = run({"call": ("benchmarks.suites.nodestore", "epochs", (s,))})
            rows.append({"budget": budget, "shuffle_block": block, **got})
            print(json.dumps(rows[-1]), flush=True)
    lines = [
        f"{spec.describe()}; stored {du(path) / 1e9:.2f} GB; local disk, a consumer taking 50 ms a batch.",
        "",
        "| memory_budget | shuffle_block | samples/s | peak RSS of the tree MB | bytes_held_peak MB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        e = r["epochs"][0] if "epochs" in r else {}
        budget = "default" if r["budget"] is None else f"{r['budget'] >> 20} MB"
        lines.append(
            f"| {budget} | {r['shuffle_block']} | "
            f"{e.get('samples_per_s', 0):,.0f} | {r.get('peak_rss_mb', 0):,.0f} | {e.get('bytes_held_peak', 0) / 1e6:,.0f} |"
        )
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "memory.json").write_text(json.dumps(rows, indent=1))
    (a.out / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    from benchmarks.peers.harness import Runner
    from benchmarks.testbeds.world import DatasetSpec, world

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--memory", action="store_true", help="the memory section only (local, large PNG rows)")
    ap.add_argument("--memory-rows", type=int, default=3000)
    ap.add_argument("--rows", type=int, default=30000)
    ap.add_argument("--distinct", type=int, default=None, help="make this many rows, each stored rows/distinct times")
    ap.add_argument("--rtts", default="0,50")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--readers", default=",".join(READERS))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "nodestore")
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()
    if a.memory:
        memory_main(a)
        return
    a.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(a).items()}, "runs": []}
    spec = DatasetSpec(rows=a.rows, image_format="jpg", distinct=a.distinct)
    with world(ROOT / "data" / "bench") as w:
        w.add("large", spec)
        stored = du(w.local["large"])
        results |= {"world": w.describe(), "dataset": spec.describe(), "stored_bytes": stored}
        run = Runner(a.timeout, enter=w.net.enter_client)
        local = {"url": w.url("large", True), "creds": None, "workers": 0, "options": {}, "epochs": 1}
        got = run({"call": ("benchmarks.suites.nodestore", "epochs", (local,))})
        results["runs"].append({"reader": "local", "rtt_ms": None, **got})
        print(json.dumps(results["runs"][-1]), flush=True)
        for rtt in (float(x) for x in a.rtts.split(",")):
            w.set_rtt(rtt)
            for name in a.readers.split(","):
                r = READERS[name]
                n = 2 if name == "nostore" else a.epochs
                s = {"url": w.url("large", False), "creds": w.reader_creds(False), **r, "epochs": n}
                got = run({"call": ("benchmarks.suites.nodestore", "epochs", (s,))})
                results["runs"].append({"reader": name, "rtt_ms": rtt, **got})
                print(json.dumps(results["runs"][-1]), flush=True)
                (a.out / "results.json").write_text(json.dumps(results, indent=1))
    (a.out / "table.md").write_text(table(results))
    print(table(results))


def table(results: dict[str, Any]) -> str:
    stored = results["stored_bytes"]
    local = next((r for r in results["runs"] if r["reader"] == "local" and "epochs" in r), None)
    ref = local["epochs"][0]["samples_per_s"] if local else None
    lines = [
        f"{results['dataset']}; stored {stored / 1e9:.2f} GB. {results['world']['network']}.",
        "",
        "| RTT | reader | epoch | samples/s | × local copy | received / stored | first batch s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["runs"]:
        if "epochs" not in r:
            lines.append(f"| {r['rtt_ms']} | {r['reader']} | error: {r.get('error')} | | | | | |")
            continue
        for e in r["epochs"]:
            rtt = "local" if r["rtt_ms"] is None else f"{r['rtt_ms']:g} ms"
            x = f"{e['samples_per_s'] / ref:.2f}×" if ref else ""
            lines.append(
                f"| {rtt} | {r['reader']} | {e['epoch']} | {e['samples_per_s']:,.0f} | {x} | "
                f"{e['rx_bytes'] / stored:.3f} | {e['first_batch_s']:.2f} | {r['peak_rss_mb']:,.0f} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
