"""The one timing harness: a reader in a fresh process, one whole first epoch, what it cost.

``Runner`` starts each measurement in a new process forked from a forkserver that imported torch,
asyncload and every reader module but never read (so each run opens its dataset cold, without paying
~3 s of imports); started inside a network namespace, it puts every thread of every run on the emulated
path. ``measure_reader`` runs in that process:

- ``run_samples_per_s``: samples over the whole run, from opening the dataset to the last sample: the
  figure every table uses. A window inside the epoch would let a reader that stops issuing at the window's
  end drain its tail for free, and one that started after a warm-up credits what was banked meanwhile
  (measured on the WAN testbed: ±30% swings between readers from where the window fell);
- ``samples_per_s``: from the first batch to the last (time to the first batch reported on its own);
- ``cpu_ms_per_sample``: CPU (user + system) of the process tree over the run, per sample, from ``/proc``
  (DataLoader workers and reader processes included), and per thread group (``thread_cpu_ms_per_sample``).
  Deep Lake's import is in it once for every reader, as a user's script pays it: in the measured process
  before the clock starts where the reader reads there (``deeplake_import_cpu_s``), in asyncload's reader
  process otherwise (the training process never imports it). Until 2026-11-30 the forkserver preloaded
  Deep Lake, so that only asyncload's reader process paid an import (in a measured process it costs
  0.06-0.07 s of CPU: torch has imported numpy by then);
- ``peak_rss_mb``: peak resident memory of the process tree, sampled every 0.1 s;
- ``rx_bytes_per_sample`` and TCP counters of the client namespace.

A reader that has not finished the epoch ``epoch_s`` after its first batch is stopped (the synchronous
DataLoaders, which would take minutes); the tables say how many rows it read.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

import numpy as np

#: What an asyncload run reports from ``loader.stats()`` (as ``asyncload_<key>``).
ASYNCLOAD_STATS = (
    "concurrency", "read_p50_ms", "read_p99_ms", "consumer_wait_s", "requests", "hedges", "hedges_won",
    "samples_read", "samples_yielded", "cpu_decode_s", "cpu_collate_s", "memory_budget", "bytes_held_peak",
    "remote_bytes", "node_hits", "node_misses",  # the node store: a run's first epoch is cold (no hits)
)  # fmt: skip

#: Where a reader's time goes (wall seconds; the keys of asyncload's ``stats()``, which the hand-written
#: reader reports too): recorded as ``stage_wall_s`` for the side-by-side table.
WALL_STATS = (
    "open_s", "reader_start_s", "first_read_at_s", "requests", "read_s", "remote_bytes", "decode_s", "store_write_s",
    "collate_s", "queue_s",
)  # fmt: skip

#: The live reader's extra figures (an AsyncLoader's ``stats``), read before the iterator is closed.
LIVE: dict[str, Any] = {}


def _stat_cpu_s(path: str, reaped: bool = False) -> float:
    """CPU seconds (user + system) in a ``/proc/.../stat`` file, with reaped children's if ``reaped``."""
    with open(path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11 : 15 if reaped else 13]) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int, reaped: bool = False) -> float:
    """CPU seconds of one process from /proc (0 if it is gone), with its reaped children's if ``reaped``."""
    try:
        return _stat_cpu_s(f"/proc/{pid}/stat", reaped)
    except (OSError, IndexError, ValueError):
        return 0.0


def tree_cpu_s(pid: int | None, reaped: bool = False) -> float:
    """CPU seconds of a process and its live descendants (see ``proc_cpu_s``); 0 for no process."""
    from asyncload.tools.measure import tree_pids

    return sum(proc_cpu_s(p, reaped) for p in tree_pids(pid)) if pid else 0.0


def cpu_jiffies(lines: Collection[str] = ("cpu",)) -> tuple[int, int]:
    """(busy, all) jiffies of the ``/proc/stat`` lines named: ``cpu`` the whole machine, ``cpu<N>`` one core.
    All is the first eight fields (user to steal: guest time is counted in user already), busy all but idle
    and iowait."""
    busy = total = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name in lines:
                t = [int(x) for x in ticks[:8]]
                total += sum(t)
                busy += sum(t) - t[3] - t[4]
    return busy, total


def _thread_group(name: str) -> str:
    """A thread's group: its name without the pool index (``decode_0`` and ``decode_1`` are one)."""
    return re.sub(r"[-_]?\d+$", "", name) or name


def _thread_cpu_s(task: str) -> float:
    """A thread's CPU seconds, exactly: ``schedstat``'s time on the CPU (ns). Not ``stat``'s utime and stime,
    which are tick samples per thread and miss threads that run in bursts shorter than a tick (Deep Lake's
    storage threads: 0.01 ms a sample by ticks against 0.18-1.20 by ``schedstat``,
    ``benchmarks/results/cpu/README.md``). Process totals are exact either way."""
    try:
        with open(f"{task}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):  # a kernel without schedstats
        return _stat_cpu_s(f"{task}/stat")


def thread_cpu_s(pid: int | None = None) -> dict[str, float]:
    """CPU seconds of this process's live threads by group: Python threads by their ``threading`` name
    (the consumer is ``MainThread``), native ones by their kernel name (Deep Lake's pool is ``B_<n>``).
    Another process's (``pid``) by kernel name only (Python 3.11 gives its threads none of their own)."""
    py_names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None} if pid is None else {}
    out: dict[str, float] = {}
    task = f"/proc/{pid or 'self'}/task"
    for tid in os.listdir(task):
        try:
            with open(f"{task}/{tid}/comm") as f:
                comm = f.read().strip()
            cpu = _thread_cpu_s(f"{task}/{tid}")
        except OSError:
            continue
        name = py_names.get(int(tid))
        group = _thread_group(name) if name else ("deeplake B_*" if comm.startswith("B_") else _thread_group(comm))
        out[group] = out.get(group, 0.0) + cpu
    return out


def net_counters() -> dict[str, int]:
    """This network namespace's TCP counters (connections opened, segments retransmitted) and bytes received
    on its non-loopback interfaces. One measured process runs in the client namespace at a time, so a
    delta over a run is that run's."""
    with open("/proc/net/snmp") as f:
        head, values = [line.split() for line in f if line.startswith("Tcp:")][:2]
    tcp = dict(zip(head[1:], map(int, values[1:]), strict=True))
    with open("/proc/net/dev") as f:
        rx = sum(int(line.split(":")[1].split()[0]) for line in f if ":" in line and line.split(":")[0].strip() != "lo")
    return {"tcp_opens": tcp["ActiveOpens"], "tcp_retrans_segs": tcp["RetransSegs"], "rx_bytes": rx}


def _count(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(next(v for k, v in batch.items() if k != "index"))
    if isinstance(batch, (list, tuple)):
        return len(batch[0])
    return len(batch)


def index_order(rows: int, order: str, seed: int = 0) -> list[int]:
    """Every row once: ``sequential``, one fixed permutation (``shuffled``, the same for every reader), or
    ``blocks:B:W``: asyncload's block order (blocks of B contiguous rows in a random order, each W rows
    mixed; ``sampler.block_order``) for a plain reader to read as asyncload does."""
    if order == "sequential":
        return list(range(rows))
    if order.startswith("blocks:"):
        from asyncload.engine.sampler import block_order

        block, window = (int(x) for x in order.split(":")[1:])
        return block_order(rows, block, window, np.random.default_rng(seed)).tolist()
    return [int(i) for i in np.random.default_rng(seed).permutation(rows)]


def stages(
    total_s: float, children_s: float, threads: dict[str, float], stats: dict[str, Any], harness_s: float
) -> dict[str, float]:
    """asyncload's CPU by stage, in seconds (``asyncload.tools.measure.cpu_stages``, as ``asyncload load``
    reports it), child processes as ``children``: the consumer is the main thread."""
    from asyncload.tools.measure import cpu_stages

    parts = cpu_stages(
        total_s, children_s, float(stats.get("cpu_decode_s") or 0.0), float(stats.get("cpu_collate_s") or 0.0),
        threads.get("MainThread", 0.0), harness_s,
    )  # fmt: skip
    parts["children"] = parts.pop("reader processes")
    return parts


def reads_here(spec: dict[str, Any]) -> bool:
    """Whether the reader reads Deep Lake in the measured process: every reader but asyncload with a reader
    process (``processes`` other than 0), whose training process never imports Deep Lake."""
    return spec["reader"] != "asyncload" or (spec.get("options") or {}).get("processes") == 0


def _import_deeplake() -> float:
    """Import Deep Lake here; the CPU seconds it took (this process's, all threads)."""
    t = time.process_time()
    import deeplake  # noqa: F401

    return time.process_time() - t


def measure_reader(spec: dict[str, Any]) -> dict[str, Any]:
    """Open and read one first epoch (every one of ``rows`` rows in ``order``), or what comes within
    ``epoch_s`` seconds of the first batch, in this process; report what it cost (module docstring)."""
    import sys

    from asyncload.tools.measure import PeakRSS

    from . import batches

    order = index_order(spec["rows"], spec["order"], spec.get("seed", 0))
    n = spec.get("limit") or spec["rows"]  # the first ``limit`` rows of the order, or all of them
    # every 0.1 s, not PeakRSS's default 20 ms: walking /proc for a process with Deep Lake's ~70 threads
    # 50 times a second took ~5% of a core, charged to every reader on a CPU-bound machine
    rss = PeakRSS(every_s=0.1)
    net0, thr0, c0, own0 = net_counters(), thread_cpu_s(), tree_cpu_s(os.getpid()), proc_cpu_s(os.getpid())
    import_s = _import_deeplake() if reads_here(spec) else None  # (counted in the CPU, before the clock)
    t_start = time.perf_counter()
    it = batches(spec, order)
    seen = s_first = 0
    t_first = wall_first = None
    try:
        for b in it:
            seen += _count(b)
            now = time.perf_counter()
            if t_first is None:
                t_first, s_first, wall_first = now, seen, time.time()
            if seen >= n or now - t_first >= spec["epoch_s"]:
                break
    finally:
        t1, c1, own1, wall1 = time.perf_counter(), tree_cpu_s(os.getpid()), proc_cpu_s(os.getpid()), time.time()
        net1, thr1 = net_counters(), thread_cpu_s()
        stats = LIVE["stats"]() if "stats" in LIVE else {}
        close = getattr(it, "close", None)
        if close is not None:
            close()
    peak = rss.stop()
    if t_first is None:
        return {"error": "no batch read", "samples": seen}
    net = {k: v - net0[k] for k, v in net1.items()}
    threads = {k: v - thr0.get(k, 0.0) for k, v in thr1.items()}
    per = 1e3 / seen
    out = {
        "samples_per_s": (seen - s_first) / (t1 - t_first) if seen > s_first else None,  # one batch: no span
        "run_samples_per_s": seen / (t1 - t_start),
        "cpu_ms_per_sample": (c1 - c0) * per,
        "peak_rss_mb": peak,
        "samples": seen,
        "first_batch_samples": s_first,
        "epoch_complete": seen >= n,
        "first_batch_s": t_first - t_start,
        "seconds": t1 - t_start,
        "rx_bytes_per_sample": net["rx_bytes"] / seen,
        "thread_cpu_ms_per_sample": {k: round(v * per, 3) for k, v in sorted(threads.items())},
        "span_unix": [wall_first, wall1],
        "storage_threads": sys.modules["deeplake"].storage.concurrency() if "deeplake" in sys.modules else None,
        "deeplake_import_cpu_s": import_s,
        # the machine's 1-minute load at the end: other people's work on a shared machine shows here
        "load_1min": os.getloadavg()[0],
        **net,
        **{f"asyncload_{k}": stats[k] for k in ASYNCLOAD_STATS if k in stats},
    }
    wall = {k: stats[k] for k in WALL_STATS if stats.get(k) is not None}
    if wall:
        out["stage_wall_s"] = wall
    if spec["reader"] == "asyncload":
        children = max((c1 - c0) - (own1 - own0), 0.0)
        parts = stages(c1 - c0, children, threads, stats, threads.get("peak-rss", 0.0))
        out["stage_cpu_ms_per_sample"] = {k: round(v * per, 3) for k, v in parts.items()}
        out["stage_cpu_from_stats"] = "cpu_decode_s" in stats
    return out


def measure_with_env(spec: dict[str, Any]) -> dict[str, Any]:
    """``measure_reader`` in a new interpreter started with the spec's environment variables: Deep Lake
    reads its (``DEEPLAKE_FS_CACHE_PATH``...) when it is imported, which a forkserver child has done
    already. ``{run}`` in a value becomes a fresh directory, whose size at the end is reported as
    ``disk_cache_mb`` and which is removed after. The child inherits this process's network namespace."""
    import json
    import shutil
    import subprocess
    import sys
    import tempfile

    scratch = tempfile.mkdtemp(prefix="asyncload-bench-")
    env = {**os.environ, **{k: v.replace("{run}", scratch) for k, v in spec["env"].items()}}
    code = "import json, sys; from benchmarks.peers.harness import measure_reader as m; print(json.dumps(m(json.loads(sys.argv[1]))))"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, json.dumps(spec)], env=env, cwd=root, capture_output=True, text=True
        )
        lines = done.stdout.strip().splitlines()
        out = json.loads(lines[-1]) if lines else {"error": f"exit {done.returncode}: {done.stderr[-500:]}"}
        out["disk_cache_mb"] = _du_mb(scratch)
        return out  # type: ignore[no-any-return]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _du_mb(path: str) -> float:
    """Megabytes of files under ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total / 1e6


def _child(spec: dict[str, Any], conn: Any) -> None:
    """In the fresh process: measure, send, exit hard (Deep Lake's threads can crash a normal interpreter
    exit after ``get_async``; the result is already out). ``spec["call"]`` runs another function instead
    (the path check), given as ``(module, name, args)``."""
    from asyncload.tools.coldstore import cold_cache_dir

    # Every run starts cold: a node block store of its own (asyncload keeps what it fetched on local disk,
    # and a store shared by the runs would serve every run after the first from there), removed after;
    # ``$ASYNCLOAD_CACHE_DIR`` names it, so the processes the run starts read through it too.
    with cold_cache_dir(env=True):
        try:
            if "call" in spec:
                import importlib

                module, name, args = spec["call"]
                out = getattr(importlib.import_module(module), name)(*args)
            elif spec.get("env"):
                out = measure_with_env(spec)
            else:
                out = measure_reader(spec)
        except BaseException as exc:  # noqa: BLE001 - reported, never raised across processes
            out = {"error": f"{type(exc).__name__}: {exc}"}
    conn.send(out)
    conn.close()
    os._exit(0)


class Runner:
    """Fresh processes from one forkserver that preloaded the heavy imports (~3 s each otherwise).

    ``enter``, if given, moves the calling thread into the client's network namespace while the
    forkserver starts (``netem.inside``), so that every thread of every child, including those Deep Lake
    recreates at fork time, is on the emulated path. Without it the runs read as the caller does (local
    disk). One forkserver per process: a second ``Runner`` shares it, so make one per suite.
    """

    def __init__(self, timeout_s: float, enter: Callable[[], None] | None = None) -> None:
        import compileall
        import pkgutil
        from multiprocessing import forkserver

        import asyncload

        from . import modules

        # asyncload's bytecode, as pip writes it when it installs the wheel: a reader process asyncload spawns
        # is a new interpreter, which would compile every module it imports (0.1-0.25 s of CPU charged to
        # asyncload) where PYTHONDONTWRITEBYTECODE is set, as on this project's machines.
        compileall.compile_dir(asyncload.__path__[0], quiet=1)
        self.timeout_s = timeout_s
        self.ctx = mp.get_context("forkserver")
        # Every asyncload module, not only the package: a module imported lazily in a child would come
        # from disk, and in a checkout being edited meanwhile it may no longer match the preloaded ones.
        ours = [
            m.name
            for m in pkgutil.walk_packages(asyncload.__path__, "asyncload.")
            if not m.name.endswith("__main__") and ".testing" not in m.name
        ]
        extra = [m for m in ("spdl.pipeline", "simplejpeg", "cv2") if _importable(m)]
        # Not Deep Lake: a user's script that reads it in process pays its import, and asyncload's reader
        # process pays it there, so each run imports it (``measure_reader``: in its CPU, not its clock).
        self.ctx.set_forkserver_preload(["torch", "asyncload", *ours, *extra, __name__, *modules()])
        if enter is None:
            forkserver.ensure_running()
        else:
            from benchmarks.testbeds import netem

            with netem.inside(enter):
                forkserver.ensure_running()

    def __call__(self, spec: dict[str, Any], on_start: Callable[[int], None] | None = None) -> dict[str, Any]:
        """``spec`` measured in a fresh child; ``on_start(pid)`` is called once it runs (the probe's hook)."""
        recv, send = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=_child, args=(spec, send), daemon=False)
        p.start()
        send.close()
        if on_start is not None:
            on_start(p.pid)
        try:
            out = recv.recv() if recv.poll(self.timeout_s) else {"error": f"no result within {self.timeout_s:.0f}s"}
        except EOFError:
            out = {"error": "the process died without a result"}
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
        if p.exitcode not in (0, None) and "error" not in out:
            out["exitcode"] = p.exitcode
        return out


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def median_run(runs: list[dict[str, Any]], key: str = "run_samples_per_s") -> dict[str, Any] | None:
    """The median repetition by ``key`` (failed runs left out), with every run's figure beside it."""
    ok = sorted((m for m in runs if key in m), key=lambda m: m[key])
    if not ok:
        return None
    return {**ok[len(ok) // 2], "runs": len(ok), "all_sps": [round(m[key], 1) for m in ok]}


def drain(it: Iterator[Any]) -> int:
    """Samples in an iterator of batches (the smoke checks)."""
    return sum(_count(b) for b in it)
