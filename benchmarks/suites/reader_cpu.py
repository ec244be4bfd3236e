"""Where the isolated reader process's CPU goes, and the same run for two checkouts (before/after).

    nice -n 5 .venv/bin/python benchmarks/suites/reader_cpu.py --tree /tmp/base --tree . \\
        --dataset png --where local --where s3 --reps 3 [--set decode=store] [--out benchmarks/results/cpu]

Each run is a fresh process (``--child``) that imports asyncload from the checkout named by ``--tree``
(``PYTHONPATH``; the reader process it spawns inherits the path), builds ``AsyncLoader(DeepLakeSource(url),
32, shuffle=True, seed=0)`` with the defaults (``processes="auto"``: one reader process) and a private, empty
node store, waits ``--settle`` seconds so that the reader's start-up (interpreter, imports, its open of the
dataset) is over and can be counted apart, then reads one whole epoch. From ``/proc`` it records:

- the reader process's CPU at the end of the settle (start-up) and at the end of the epoch, and its
  threads' CPU by name (``schedstat``, exact; sampled every 0.5 s, so a thread that ends is counted as of
  its last sample; ``stat``'s tick counts beside it, which miss most of Deep Lake's storage threads);
- the training process's own CPU over the epoch (``getrusage``), and its threads by name (read before the
  last batch: the epoch's loop, lane and CPU pool end with it);
- samples/s over the epoch (first ``next()`` to the last batch).

``--later N`` reads N more epochs after the first, each reported apart (samples/s, the tree's CPU a sample,
rows read back from the node store): what the store's writes of the first epoch buy. ``--tree
.@READER_CPU_PEER=bytes`` runs the hand-written reader (``peers.bytes_jpeg``) over the same epochs instead.

Runs alternate between trees within a repetition, so a change in load hits both. ``--where s3`` serves the
dataset from a SeaweedFS server on loopback (``harness.seaweed``; no emulated latency: loopback round trips);
``local`` reads the directory under ``data/bench``; ``--where wan`` (alone: it leaves the orchestrator in the
server's network namespace) serves it from SeaweedFS behind the packet-level delay line of ``make bench``
(``benchmarks.testbeds.world``, root; ``--rtt``), each run in the client's namespace. The report (``--out``)
is markdown plus the raw JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATASETS = {
    "png": "data/bench/photos-1000-png",
    "jpeg": "data/bench/photos-4000-jpg",
    "jpeg20k": "data/bench/photos-20000x4000-jpg",
}
TICK = os.sysconf("SC_CLK_TCK")


def _schedstat_s(task: str) -> float:
    with open(f"{task}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _ticks_s(task: str) -> float:
    with open(f"{task}/stat") as f:
        st = f.read()
    fields = st[st.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _per_thread(pid: int, cpu_s: Any) -> dict[int, tuple[str, float]]:
    """tid → (name, CPU seconds by ``cpu_s``) of ``pid``'s live threads."""
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/comm") as f:
                name = f.read().strip()
            out[int(t)] = (name, cpu_s(f"/proc/{pid}/task/{t}"))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    """tid → (name, CPU seconds) of ``pid``'s live threads, from ``schedstat`` (nanoseconds on a CPU, exact):
    ``stat``'s utime and stime are tick samples, which miss most of Deep Lake's storage threads' short bursts
    (summed over threads they showed a tenth of what ``perf`` and the process total saw)."""
    return _per_thread(pid, _schedstat_s)


def _thread_ticks(pid: int) -> dict[int, tuple[str, float]]:
    """tid → (name, CPU seconds) from ``stat``'s utime + stime: what ``/proc`` per-thread tables usually
    show, kept beside ``schedstat`` to show how much of Deep Lake's threads it misses."""
    return _per_thread(pid, _ticks_s)


def _python_names(pid: int) -> dict[int, str]:
    """OS thread id → Python thread name of ``pid`` (``py-spy dump``): Python threads all show as ``python``."""
    spy = str(Path(sys.executable).with_name("py-spy"))
    try:
        text = subprocess.run([spy, "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True,
                              timeout=20).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    return {int(m[1]): m[2] for m in re.finditer(r'Thread (\d+) \([^)]*\): "([^"]*)"', text)}


def _proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            s = f.read()
    except OSError:
        return 0.0
    fields = s[s.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _hwm_mb(pid: int) -> float:
    """``pid``'s peak resident set (``VmHWM``), MB; 0 where it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM:")), 0.0)
    except OSError:
        return 0.0


def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    s = f.read()
            except OSError:
                continue
            if int(s[s.rindex(")") + 2 :].split()[1]) == pid:
                kids.append(int(d))
    return kids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return ""


def _group(name: str) -> str:
    return re.sub(r"[-_]?\d+$", "", name) or name


class _Sampler:
    """Every 0.5 s, the last CPU seen of each thread of each watched process (threads that end keep theirs)."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.seen: dict[tuple[int, int], tuple[str, float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            self.sample()

    def sample(self) -> None:
        for pid in list(self.pids):
            for tid, v in _threads(pid).items():
                self.seen[(pid, tid)] = v

    def snapshot(self, pid: int) -> dict[int, tuple[str, float]]:
        self.sample()
        return {tid: v for (p, tid), v in self.seen.items() if p == pid}


def _by_group(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], names: dict[int, str]
) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for tid, (name, cpu) in after.items():
        out[_group(names.get(tid, name))] += cpu - before.get(tid, (name, 0.0))[1]
    return dict(out)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One measured run in this (fresh) process."""
    import resource

    if os.environ.get("READER_CPU_PEER") == "bytes":
        return _peer_child(spec)

    from asyncload import AsyncLoader, DeepLakeSource
    from asyncload.tools.coldstore import cold_cache_dir

    me = os.getpid()
    sampler = _Sampler()
    with cold_cache_dir() as cache:
        t0 = time.perf_counter()
        src = DeepLakeSource(spec["url"], creds=spec.get("creds"), **spec.get("source_options", {}))
        loader = AsyncLoader(src, batch_size=32, shuffle=True, seed=0, cache_dir=cache, **spec.get("options", {}))
        readers = _children(me)
        cmdlines = {k: _cmdline(k) for k in readers}
        sampler.pids.extend(readers)
        time.sleep(spec["settle"])
        startup = {k: _proc_cpu(k) for k in readers}
        r_before = {k: sampler.snapshot(k) for k in readers}
        ticks_before = {k: _thread_ticks(k) for k in readers}
        names = {k: _python_names(k) for k in readers}
        names[me] = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        m_before = _threads(me)
        perf = _profile(spec, readers)
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t1 = time.perf_counter()
        n = 0
        last = len(loader) - 2  # the training process's threads are read before the last batch: the epoch's
        m_after = m_before  # loop, lane and CPU pool end with it, and their CPU with them
        for k, batch in enumerate(loader):
            n += len(batch["index"])
            if k == last:
                m_after = _threads(me)
                names[me].update({t.native_id: t.name for t in threading.enumerate() if t.native_id is not None})
        t2 = time.perf_counter()
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        # any reader started during the epoch (a replacement) is counted too
        readers_now = [k for k in _children(me) if k not in readers]
        end = {k: _proc_cpu(k) for k in readers + readers_now}
        hwm = {"main": _hwm_mb(me), "readers": sum(_hwm_mb(k) for k in readers + readers_now)}
        names[me].update({t.native_id: t.name for t in threading.enumerate() if t.native_id is not None})
        r_after = {k: sampler.snapshot(k) for k in readers}
        ticks_after = {k: _thread_ticks(k) for k in readers}
        stats = loader.stats()
        later = [_later_epoch(loader, e, me, readers) for e in range(1, 1 + spec.get("later", 0))]
        if perf is not None:
            perf.send_signal(signal.SIGINT)
            perf.wait(30)
        loader.close()
    sampler.stop.set()
    own = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    reader_epoch = sum(end[k] - startup.get(k, 0.0) for k in end)
    groups: dict[str, float] = defaultdict(float)
    for k in readers:
        for g, v in _by_group(r_before[k], r_after[k], names[k]).items():
            groups[g] += v
    ticks: dict[str, float] = defaultdict(float)
    for k in readers:
        for g, v in _by_group(ticks_before[k], ticks_after[k], names[k]).items():
            ticks[g] += v
    return {
        "reader_threads_ticks_s": dict(ticks),
        "rows": n,
        "epoch_s": t2 - t1,
        "open_s": t1 - t0 - spec["settle"],
        "samples_per_s": n / (t2 - t1),
        "readers": len(readers) + len(readers_now),
        "children": {str(k): [cmdlines.get(k) or _cmdline(k), startup.get(k), end.get(k)] for k in end},
        "reader_startup_cpu_s": sum(startup.values()),
        "reader_epoch_cpu_s": reader_epoch,
        "main_epoch_cpu_s": own,
        "reader_threads_s": dict(groups),
        "main_threads_s": _by_group(m_before, m_after, names[me]),
        "retries": stats.get("retries"),
        "peak_rss_mb": hwm,
        "load": os.getloadavg()[0],
        "later": later,
    }


def _peer_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The hand-written reader (``peers.bytes_jpeg``: ``get_bytes_async``, simplejpeg and lz4 on 2 threads) over
    the same epochs as ``child`` (``--tree .@READER_CPU_PEER=bytes``): each epoch a new shuffled order, the
    dataset opened by the reader as ``make bench`` runs it, again at each epoch's start (``batches`` opens it;
    Deep Lake imported first, before the clock)."""
    import deeplake  # noqa: F401 - (before the clock, as asyncload's reader process's start is counted apart)
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from benchmarks.peers import bytes_jpeg
    from benchmarks.peers.common import open_dataset

    peer = {"url": spec["url"], "creds": spec.get("creds"), "options": {"masks": "bytes"}}
    n = len(open_dataset(peer))
    epochs = []
    for e in range(1 + spec.get("later", 0)):
        order = [int(i) for i in np.random.default_rng(e).permutation(n)]
        c0, t0 = time.process_time(), time.perf_counter()  # (process_time: this process's user + system CPU)
        rows = sum(int(b["images"].shape[0]) for b in bytes_jpeg.batches(peer, order))
        t1, cpu = time.perf_counter(), time.process_time() - c0
        epochs.append({"epoch": e, "rows": rows, "samples_per_s": rows / (t1 - t0), "cpu_s": cpu})
    first = epochs[0]
    later = [
        {"epoch": x["epoch"], "rows": x["rows"], "samples_per_s": x["samples_per_s"],
         "tree_cpu_ms_per_sample": 1000 * x["cpu_s"] / x["rows"], "reader_cpu_ms_per_sample": 0.0, "node_hits": 0}
        for x in epochs[1:]
    ]  # fmt: skip
    return {
        "rows": first["rows"], "epoch_s": first["rows"] / first["samples_per_s"], "open_s": 0.0,
        "samples_per_s": first["samples_per_s"], "readers": 0, "children": {}, "reader_startup_cpu_s": 0.0,
        "reader_epoch_cpu_s": 0.0, "main_epoch_cpu_s": first["cpu_s"], "reader_threads_s": {},
        "reader_threads_ticks_s": {}, "main_threads_s": {}, "retries": None, "load": os.getloadavg()[0],
        "later": later,
    }  # fmt: skip


def _later_epoch(loader: Any, epoch: int, me: int, readers: list[int]) -> dict[str, float]:
    """One more whole epoch of ``loader`` (``set_epoch(epoch)``): samples/s and the tree's CPU a sample (this
    process's own, its reader processes' from ``/proc``), rows read from the node store."""
    loader.set_epoch(epoch)
    pids = list(dict.fromkeys(readers + _children(me)))
    r0 = {k: _proc_cpu(k) for k in pids}
    c0, t0 = time.process_time(), time.perf_counter()
    n = sum(len(b["index"]) for b in loader)
    t1, own = time.perf_counter(), time.process_time() - c0
    pids += [k for k in _children(me) if k not in pids]
    reader = sum(_proc_cpu(k) - r0.get(k, 0.0) for k in pids)
    return {
        "epoch": epoch,
        "rows": n,
        "samples_per_s": n / (t1 - t0),
        "tree_cpu_ms_per_sample": 1000 * (own + reader) / max(n, 1),
        "reader_cpu_ms_per_sample": 1000 * reader / max(n, 1),
        "node_hits": loader.stats().get("node_hits", 0),  # (``stats()`` is the epoch's own)
    }


def _profile(spec: dict[str, Any], readers: list[int]) -> subprocess.Popen[bytes] | None:
    """``perf record`` (``spec["perf"]``: the output file) or ``py-spy record`` (``spec["pyspy"]``) of the reader
    (or of the training process, ``spec["profile"] == "main"``) over the epoch: for shares of where its CPU
    goes, never for the throughput of the same run."""
    if spec.get("profile") == "main":
        reader = os.getpid()
    elif not readers:
        return None
    else:
        reader = max(readers, key=_proc_cpu)
    if spec.get("perf"):
        cmd = ["perf", "record", "-F", "997", "-g", "-p", str(reader), "-o", spec["perf"]]
    elif spec.get("pyspy"):
        spy = str(Path(sys.executable).with_name("py-spy"))
        # --native for the reader, whose CPU is mostly Deep Lake's; Python frames alone for the training
        # process, where --native slowed the epoch by a third and counted threads waiting for the GIL as busy
        native = ["--native", "--rate", "500"] if spec.get("profile") != "main" else ["--rate", "250"]
        cmd = [spy, "record", "--pid", str(reader), "--threads", "--format", "raw", *native,
               "--output", spec["pyspy"]]  # fmt: skip
    else:
        return None
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    return p


def _run_child(tree: str, spec: dict[str, Any], prefix: list[str]) -> dict[str, Any]:
    """``tree``: a checkout, optionally with environment variables for the run: ``path@KEY=VALUE,KEY=VALUE``, loader options as ``opt.NAME=JSON``, source options as ``src.NAME=JSON``."""
    path, _, extra = tree.partition("@")
    env = dict(os.environ, PYTHONPATH=str(Path(path).resolve()))
    for kv in extra.split(","):
        if kv.startswith("src."):  # a source option: src.storage_concurrency=64
            k, v = kv[4:].split("=", 1)
            spec = {**spec, "source_options": {**spec.get("source_options", {}), k: json.loads(v)}}
        elif kv.startswith("opt."):  # a loader option for this tree's runs: opt.processes=0
            k, v = kv[4:].split("=", 1)
            spec = {**spec, "options": {**spec["options"], k: json.loads(v)}}
        elif kv:
            k, v = kv.split("=", 1)
            env[k] = v
    cmd = [*prefix, sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    # In the tree: the node's shared reader that a run starts (``python -c``) imports the asyncload of its working
    # directory, which must be the tree's, or a "before" run would read through this checkout's server.
    p = subprocess.run(cmd, env=env, cwd=str(Path(path).resolve()), capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        return {"error": f"rc {p.returncode}: {p.stderr[-2000:]}"}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--tree", action="append", help="a checkout whose asyncload to run (repeatable)")
    ap.add_argument("--dataset", action="append", choices=sorted(DATASETS))
    ap.add_argument("--where", action="append", choices=["local", "s3", "wan"])
    ap.add_argument("--rtt", type=float, default=50.0, help="round trip of --where wan, ms")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settle", type=float, default=4.0)
    ap.add_argument("--later", type=int, default=0, help="epochs read after the first, each reported apart")
    ap.add_argument("--set", action="append", default=[], help="loader option key=value (json value)")
    ap.add_argument("--out", help="a folder for report.md and results.json")
    ap.add_argument("--label", default="run")
    ap.add_argument("--pyspy", help="py-spy raw stacks of each run's epoch into this file (the last run's)")
    ap.add_argument("--perf", help="perf record of each run's epoch into this file (the last run's)")
    ap.add_argument("--profile", choices=["reader", "main"], default="reader", help="what --pyspy/--perf record")
    ap.add_argument(
        "--summarize", nargs="+", help="results JSON files: print before/after tables (first tree = before)"
    )
    a = ap.parse_args(argv)
    if a.summarize:
        print(summarize([r for f in a.summarize for r in json.loads(Path(f).read_text())]))
        return 0
    if a.child:
        print(json.dumps(child(json.loads(a.child))))
        sys.stdout.flush()
        os._exit(0)
    options = {}
    for kv in a.set:
        k, v = kv.split("=", 1)
        try:
            options[k] = json.loads(v)
        except json.JSONDecodeError:
            options[k] = v
    trees = a.tree or ["."]
    datasets, wheres = a.dataset or ["png"], a.where or ["local"]
    if "wan" in wheres and len(set(wheres)) > 1:
        # the world leaves this process in the server's network namespace: loopback and local runs from
        # here would not reach their own server (nor read as a user's process does)
        ap.error("--where wan runs alone (one invocation for wan, another for local and s3)")
    server = None
    urls: dict[tuple[str, str], tuple[str, dict[str, str] | None]] = {}
    prefix: dict[str, list[str]] = {}
    stack = contextlib.ExitStack()
    sys.path.insert(0, str(ROOT))
    if "s3" in wheres:
        from harness.seaweed import SeaweedServer

        server = SeaweedServer().start()
        stack.callback(server.close)
        server.create_bucket("cpu")
    if "wan" in wheres:
        from benchmarks.testbeds.world import world

        wld = stack.enter_context(world())
        wld.set_rtt(a.rtt)
        print(f"wan: {wld.net.describe()}", flush=True)
        ns = getattr(wld.net, "ns", None)
        prefix["wan"] = ["ip", "netns", "exec", ns["client"]] if ns else []
    try:
        for d in datasets:
            local = ROOT / DATASETS[d]
            urls[(d, "local")] = (str(local), None)
            if server is not None:
                server.put_tree("cpu", d, local)
                urls[(d, "s3")] = (f"s3://cpu/{d}", server.creds())
            if "wan" in wheres:
                wld.server.put_tree(wld.bucket, d, local)
                urls[(d, "wan")] = (wld.url(d, local=False), wld.reader_creds(local=False))
        results: list[dict[str, Any]] = []
        for d in datasets:
            for w in wheres:
                url, creds = urls[(d, w)]
                for rep in range(a.reps):
                    for tree in trees:
                        spec = {"url": url, "creds": creds, "settle": a.settle, "options": options, "later": a.later,
                                "pyspy": a.pyspy, "perf": a.perf, "profile": a.profile}  # fmt: skip
                        r = _run_child(tree, spec, prefix.get(w, []))
                        r.update(dataset=d, where=w, tree=tree, rep=rep)
                        results.append(r)
                        print(_line(r), flush=True)
    finally:
        stack.close()
    table = _table(results, trees)
    print(table)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{a.label}.json").write_text(json.dumps(results, indent=1))
        (out / f"{a.label}.md").write_text(table + "\n")
    return 0


def _per(r: dict[str, Any], key: str) -> float:
    return 1000 * r[key] / r["rows"]


def _threads_per(r: dict[str, Any], key: str, *groups: str) -> float:
    """ms a sample of the thread groups ``groups`` (each once) of a run's ``key`` (``reader_threads_s``...)."""
    return 1000 * sum(r[key].get(g, 0.0) for g in dict.fromkeys(groups)) / r["rows"]


def _line(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['dataset']} {r['where']} {r['tree']}: {r['error']}"
    top = sorted(r["reader_threads_s"].items(), key=lambda kv: -kv[1])[:6]
    return (
        f"{r['dataset']} {r['where']} {r['tree']} rep {r['rep']}: {r['samples_per_s']:.0f}/s, reader start-up "
        f"{r['reader_startup_cpu_s']:.2f} s, reader epoch {_per(r, 'reader_epoch_cpu_s'):.2f} ms/sample, main "
        f"{_per(r, 'main_epoch_cpu_s'):.2f} ms/sample; reader threads (ms/sample): "
        + ", ".join(f"{g} {1000 * v / r['rows']:.2f}" for g, v in top)
        + "; training process threads: "
        + ", ".join(
            f"{g} {1000 * v / r['rows']:.2f}" for g, v in sorted(r["main_threads_s"].items(), key=lambda kv: -kv[1])[:7]
        )
        + (
            f"; peak RSS MB: training {r['peak_rss_mb']['main']:.0f}, readers {r['peak_rss_mb']['readers']:.0f}"
            if "peak_rss_mb" in r
            else ""
        )
        + f"; load {r['load']:.1f}"
    )


def _table(results: list[dict[str, Any]], trees: list[str]) -> str:
    rows = ["| dataset | where | tree | samples/s | reader start-up CPU s | reader ms/sample (epoch) | reader ms/sample "
            "(start-up + epoch) | training process ms/sample | tree ms/sample (start-up + epoch) | later epochs: "
            "samples/s, tree ms/sample | runs |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    keyed: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        if "error" not in r:
            keyed[(r["dataset"], r["where"], r["tree"])].append(r)
    for (d, w, t), rs in keyed.items():

        def m(f: Any, rs: list[dict[str, Any]] = rs) -> float:
            return statistics.median([f(r) for r in rs])

        rows.append(
            f"| {d} | {w} | {t} | {m(lambda r: r['samples_per_s']):.0f} | {m(lambda r: r['reader_startup_cpu_s']):.2f} "
            f"| {m(lambda r: _per(r, 'reader_epoch_cpu_s')):.2f} "
            f"| {m(lambda r: 1000 * (r['reader_epoch_cpu_s'] + r['reader_startup_cpu_s']) / r['rows']):.2f} "
            f"| {m(lambda r: _per(r, 'main_epoch_cpu_s')):.2f} "
            f"| {m(lambda r: 1000 * (r['reader_epoch_cpu_s'] + r['reader_startup_cpu_s'] + r['main_epoch_cpu_s']) / r['rows']):.2f} "
            f"| {_later_cell(rs)} | {len(rs)} ({', '.join(format(r['samples_per_s'], '.0f') for r in rs)}) |"
        )
    return "\n".join(rows)


def _later_cell(rs: list[dict[str, Any]]) -> str:
    """Per later epoch, the medians of its samples/s and tree CPU a sample over ``rs``; ``-`` where none."""
    cells = []
    for k in range(min(len(r.get("later") or []) for r in rs)):
        sps = statistics.median(r["later"][k]["samples_per_s"] for r in rs)
        cpu = statistics.median(r["later"][k]["tree_cpu_ms_per_sample"] for r in rs)
        cells.append(f"{sps:,.0f}, {cpu:.2f}")
    return "; ".join(cells) or "-"


def summarize(results: list[dict[str, Any]]) -> str:
    """Per dataset and place: each tree's medians, the reader's threads, and each tree's ratio to the first."""
    med = statistics.median
    keyed: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        if "error" not in r:
            keyed[(r["dataset"], r["where"])][r["tree"]].append(r)
    groups = ["B", "asyncload-reader-loop", "MainQueueThread", "asyncload-reader-send", "MainThread"]
    out = [
        "| dataset | where | tree | samples/s | reader start-up CPU s | reader ms/sample, epoch | reader, start-up "
        "included | training process | tree, start-up included | reader threads, epoch (ms/sample): Deep Lake "
        "storage B_* (ticks) / loop / MainQueueThread / send / main | training process's receive thread | training "
        "process's loop / node store writes | runs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (d, w), trees in keyed.items():
        first: dict[str, float] | None = None
        for tree, rs in trees.items():
            n = med([r["rows"] for r in rs])
            m = {
                "sps": med([r["samples_per_s"] for r in rs]),
                "start": med([r["reader_startup_cpu_s"] for r in rs]),
                "reader": med([_per(r, "reader_epoch_cpu_s") for r in rs]),
                "reader_all": med(
                    [1000 * (r["reader_epoch_cpu_s"] + r["reader_startup_cpu_s"]) / r["rows"] for r in rs]
                ),
                "main": med([_per(r, "main_epoch_cpu_s") for r in rs]),
                "tree": med(
                    [
                        1000 * (r["reader_epoch_cpu_s"] + r["reader_startup_cpu_s"] + r["main_epoch_cpu_s"]) / r["rows"]
                        for r in rs
                    ]
                ),  # fmt: skip
            }

            # (the node's shared reader names its threads asyncload-node-reader-*)
            th = {
                g: med([_threads_per(r, "reader_threads_s", g, g.replace("-reader-", "-node-reader-")) for r in rs])
                for g in groups
            }
            # the training process's loop and the node store's writes (on the lane thread since 2b79324, on the
            # loop's default executor, uvloop's threads, before it)
            loop_ = med([_threads_per(r, "main_threads_s", "asyncload-loop") for r in rs])
            store = med([_threads_per(r, "main_threads_s", "asyncload-lane", "uvloop") for r in rs])
            had = [r for r in rs if "reader_threads_ticks_s" in r]  # (runs before the probe kept them: none)
            ticks = (
                f"{med([1000 * r['reader_threads_ticks_s'].get('B', 0.0) / r['rows'] for r in had]):.2f}"
                if had
                else "-"
            )
            recv = med([_threads_per(r, "main_threads_s", "asyncload-reader-receive") for r in rs])
            ratio = "" if first is None else " ({:.2f}x)"

            def cell(k: str, fmt: str = "{:.2f}", m: Any = m, first: Any = first, ratio: str = ratio) -> str:
                return fmt.format(m[k]) + (ratio.format(m[k] / first[k]) if first and first[k] else "")

            out.append(
                f"| {d} ({n:,.0f} rows) | {w} | {tree} | {cell('sps', '{:.0f}')} | {cell('start')} | {cell('reader')} "
                f"| {cell('reader_all')} | {cell('main')} | {cell('tree')} | {th['B']:.2f} ({ticks}) / "
                f"{th['asyncload-reader-loop']:.2f} / {th['MainQueueThread']:.2f} / {th['asyncload-reader-send']:.2f} / "
                f"{th['MainThread']:.2f} | {recv:.3f} | {loop_:.2f} / {store:.2f} | {len(rs)} ({', '.join(format(r['samples_per_s'], '.0f') for r in rs)};"
                f" load {min(r['load'] for r in rs):.0f}-{max(r['load'] for r in rs):.0f}) |"
            )
            first = first or m
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
