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
import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


RANK = """
import json, sys, time
sys.path.insert(0, {root!r})
from asyncload import AsyncLoader, DeepLakeSource
src = DeepLakeSource({url!r}, columns=("images", "masks"), creds={creds!r})
loader = AsyncLoader(src, rank={rank}, world_size={world}, batch_size=32, shuffle=True, **{options!r})
out = []
for e in range({epochs}):
    loader.set_epoch(e)
    t0 = time.perf_counter()
    n = sum(len(b["index"]) for b in loader)
    s = loader.stats()
    out.append({{"samples": n, "seconds": time.perf_counter() - t0, "node_hits": s["node_hits"],
                "node_misses": s["node_misses"], "remote_bytes": s["remote_bytes"], "nodes": loader.sampler.nodes}})
loader.close()
print(json.dumps(out))
"""


def ranks(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: ``spec["ranks"]`` rank processes started together, on ``spec.get("nodes", 1)``
    simulated nodes (a fresh node store each, and the variables torchrun gives a node's ranks), each reading
    ``spec["epochs"]`` epochs of its share; the bytes received over all of them (every epoch, and per
    epoch from the ranks' own counts), and the stores' size on disk against a limit (``cache_limit`` in
    ``spec["options"]``)."""
    import subprocess

    from asyncload.tools.coldstore import dir_bytes, new_cold_dir
    from benchmarks.peers.harness import net_counters

    n, nodes = spec["ranks"], spec.get("nodes", 1)
    local = n // nodes
    stores = [new_cold_dir() for _ in range(nodes)]
    t0, net0 = time.perf_counter(), net_counters()
    procs = []
    for r in range(n):
        env = {**os.environ, "ASYNCLOAD_CACHE_DIR": stores[r // local], "WORLD_SIZE": str(n),
               "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(r // local), "RANK": str(r), "LOCAL_RANK": str(r % local)}  # fmt: skip
        procs.append(subprocess.Popen(
            [sys.executable, "-c", RANK.format(
                root=str(ROOT), url=spec["url"], creds=spec["creds"], rank=r, world=n, epochs=spec["epochs"],
                options=spec["options"],
            )],
            stdout=subprocess.PIPE, text=True, env=env,
        ))  # fmt: skip
    per_rank = [json.loads(p.communicate(timeout=3600)[0].strip().splitlines()[-1]) for p in procs]
    dt = time.perf_counter() - t0
    rx = net_counters()["rx_bytes"] - net0["rx_bytes"]
    disk = sum(dir_bytes(s) for s in stores)
    index = sum(p.stat().st_size for s in stores for p in Path(s).glob("index.sqlite3*"))
    for s in stores:
        shutil.rmtree(s, ignore_errors=True)
    return {
        "ranks": n, "nodes": nodes, "epochs": spec["epochs"], "seconds": round(dt, 2), "rx_bytes": rx,
        "store_bytes": disk, "index_bytes": index, "per_rank": per_rank, "load_1min": os.getloadavg()[0],
        "remote_bytes_per_epoch": [sum(r[e]["remote_bytes"] for r in per_rank) for e in range(spec["epochs"])],
    }  # fmt: skip


def index_cost(store: str, rows: int) -> dict[str, float]:
    """Microseconds per row of a warm epoch's look-ups in the node's index, and of its reads from the parts,
    in requests of 32 rows (what a warm epoch asks of the store)."""
    from asyncload.nodestore import NodeStore

    node = NodeStore(Path(store), None)
    with node.transaction(write=False) as db:
        (key,) = db.execute("SELECT key FROM shelves ORDER BY id LIMIT 1").fetchone()
    shelf = node.shelf(key, "bench")
    assert shelf is not None
    cols = ["images@b", "masks@b"]
    t0 = time.perf_counter()
    found = [shelf.lookup(list(range(lo, min(lo + 32, rows))), cols) for lo in range(0, rows, 32)]
    t1 = time.perf_counter()
    for f in found:
        for c in cols:
            shelf.get([e[c] for e in f.values()])
    t2 = time.perf_counter()
    return {"lookup_us_per_row": round((t1 - t0) / rows * 1e6, 2), "read_us_per_row": round((t2 - t1) / rows * 1e6, 2)}


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
                **{k: s[k] for k in ("node_hits", "node_misses", "bytes_held_peak", "remote_bytes") if k in s},
            })  # fmt: skip
    finally:
        if w:
            del dl
        else:
            loader.close()
        peak = rss.stop()
        store_mb = dir_bytes(store) / 1e6
        cost = index_cost(store, len(src)) if spec.get("index_cost") else {}
        shutil.rmtree(store, ignore_errors=True)
    return {
        "epochs": out,
        **cost,
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
    ap.add_argument("--node", action="store_true", help="the node section: rank processes sharing one store")
    ap.add_argument("--cluster", action="store_true", help="1, 2 and 4 simulated nodes of 2 ranks, 3 epochs")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "nodestore")
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()
    if a.memory:
        memory_main(a)
        return
    if a.node:
        node_main(a)
        return
    if a.cluster:
        cluster_main(a)
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


@contextlib.contextmanager
def remote(a: argparse.Namespace, section: str) -> Iterator[tuple[Any, Any, str, Any, int, Path, dict[str, Any]]]:
    """The photo dataset of ``a.rows`` on SeaweedFS behind ``a.rtts``' last delay (the packet-level testbed,
    ``testbeds.world``), a runner of fresh processes in the client's namespace, and the section's folder:
    ``(world, run, url, creds, stored bytes, out folder, description)``."""
    from benchmarks.peers.harness import Runner
    from benchmarks.testbeds.world import DatasetSpec, world

    spec = DatasetSpec(rows=a.rows, image_format="jpg", distinct=a.distinct)
    rtt = float(a.rtts.split(",")[-1])
    out = a.out / section
    out.mkdir(parents=True, exist_ok=True)
    with world(ROOT / "data" / "bench") as w:
        w.add("large", spec)
        stored = du(w.local["large"])
        w.set_rtt(rtt)
        desc = {"dataset": spec.describe(), "stored_bytes": stored, "rtt_ms": rtt}
        yield (
            w,
            Runner(a.timeout, enter=w.net.enter_client),
            w.url("large", False),
            w.reader_creds(False),
            stored,
            out,
            desc,
        )


def node_main(a: argparse.Namespace) -> None:
    """The node section: 4 ranks over 2 epochs and 8 ranks under a limit of half the dataset, sharing one
    fresh store, against one process's epoch without the store; the index's cost per row, warm."""
    runs: dict[str, Any] = {}
    with remote(a, "node") as (w, run, url, creds, stored, out, desc):
        base = {"url": url, "creds": creds, "workers": 0, "epochs": 1}
        runs["one process, cache=False"] = run({"call": ("benchmarks.suites.nodestore", "epochs", (
            {**base, "options": {"cache": False}},))})  # fmt: skip
        runs["one process, store, 2 epochs"] = run({"call": ("benchmarks.suites.nodestore", "epochs", (
            {**base, "epochs": 2, "options": {}, "index_cost": True},))})  # fmt: skip
        local = {"url": w.url("large", True), "creds": None, "workers": 0, "epochs": 1, "options": {}}
        runs["local copy"] = run({"call": ("benchmarks.suites.nodestore", "epochs", (local,))})
        for n, opts in ((4, {}), (8, {"cache_limit": stored // 2})):
            name = f"{n} ranks" + (f", cache_limit {stored // 2:,}" if opts else "")
            runs[name] = run({"call": ("benchmarks.suites.nodestore", "ranks", (
                {"url": url, "creds": creds, "ranks": n, "epochs": 2, "options": opts},))})  # fmt: skip
            runs[name]["limit"] = opts.get("cache_limit")
            print(name, json.dumps(runs[name])[:400], flush=True)
        desc |= {"world": w.describe()}
    (out / "results.json").write_text(json.dumps({**desc, "runs": runs}, indent=1))
    one = runs["one process, cache=False"]["epochs"][0]["rx_bytes"]
    lines = [
        f"{desc['dataset']}; stored {stored / 1e9:.2f} GB; {desc['world']['network']}, {desc['rtt_ms']:g} ms RTT. Every run",
        "starts from an empty store; bytes are those the client namespace received (every process of the node).",
        "",
        "| run | epochs | received / one epoch without the store | store on disk / limit | seconds |",
        "|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        if "rx_bytes" in r:
            lim = (
                f"{r['store_bytes'] / r['limit']:.3f} (index {r['index_bytes'] / 1e6:.1f} MB)" if r.get("limit") else ""
            )
            lines.append(f"| {name} | {r['epochs']} | {r['rx_bytes'] / one:.3f} | {lim} | {r['seconds']:.1f} |")
        elif "epochs" in r:
            rx = sum(e["rx_bytes"] for e in r["epochs"])
            rates = " / ".join(f"{e['samples_per_s']:,.0f}/s" for e in r["epochs"])
            lines.append(f"| {name} | {len(r['epochs'])} | {rx / one:.3f} | | {rates} |")
    warm = runs["one process, store, 2 epochs"]
    if "epochs" in warm and "epochs" in runs["local copy"]:
        ratio = warm["epochs"][1]["samples_per_s"] / runs["local copy"]["epochs"][0]["samples_per_s"]
        lines += ["", f"Warm epoch from the store: {ratio:.2f}x the same rows read from a local Deep Lake copy.",
                  f"The index, warm: {warm.get('lookup_us_per_row')} us per row to look up, "
                  f"{warm.get('read_us_per_row')} us per row to read and check (requests of 32 rows)."]  # fmt: skip
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def cluster_main(a: argparse.Namespace) -> None:
    """Simulated nodes of 2 ranks each (a node store each, torchrun's variables), 3 epochs, against one
    process's epoch without the store: what the cluster receives, with node-stable epochs (the default) and
    a global shuffle."""
    runs: dict[str, Any] = {}
    with remote(a, "cluster") as (w, run, url, creds, stored, out, desc):
        runs["one process, cache=False"] = run({"call": ("benchmarks.suites.nodestore", "epochs", (
            {"url": url, "creds": creds, "workers": 0, "epochs": 1, "options": {"cache": False}},))})  # fmt: skip
        for nodes in (1, 2, 4):
            for scope in ("node", "global") if nodes > 1 else ("node",):
                name = f"{nodes} node(s) x 2 ranks, shuffle_scope={scope}"
                runs[name] = run({"call": ("benchmarks.suites.nodestore", "ranks", (
                    {"url": url, "creds": creds, "ranks": 2 * nodes, "nodes": nodes, "epochs": 3,
                     "options": {"shuffle_scope": scope}},))})  # fmt: skip
                print(name, json.dumps({k: v for k, v in runs[name].items() if k != "per_rank"}), flush=True)
        desc |= {"world": w.describe()}
    (out / "results.json").write_text(json.dumps({**desc, "runs": runs}, indent=1))
    one = runs["one process, cache=False"]["epochs"][0]
    lines = [
        f"{desc['dataset']}; stored {stored / 1e9:.2f} GB; {desc['world']['network']}, {desc['rtt_ms']:g} ms RTT.",
        "Simulated nodes on one machine: a fresh node store each and torchrun's variables for their ranks;",
        "bytes received by the client namespace (all nodes), against one process's epoch without the store;",
        "per epoch: the bytes the ranks' read stages fetched from the source, against that process's.",
        "",
        "| run | 3 epochs received / one epoch | epoch 1 | epoch 2 | epoch 3 | stores on disk / dataset | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        if "per_rank" in r:
            per = " | ".join(f"{b / (one.get('remote_bytes') or 1):.3f}" for b in r["remote_bytes_per_epoch"])
            lines.append(f"| {name} | {r['rx_bytes'] / one['rx_bytes']:.3f} | {per} | {r['store_bytes'] / stored:.2f} | "
                         f"{r['seconds']:.0f} |")  # fmt: skip
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


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
