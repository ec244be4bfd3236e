"""Where a reader's time, bytes and connections go on the packet-level WAN: the diagnosis behind ``limits.md``.

    flock /tmp/asyncload-measure.lock python benchmarks/suites/wan_probe.py --rtt 50 --order shuffled \\
        --reader asyncload --reader column --reps 3 [--section 0] [--pyspy] [--set key=value ...]

The same world as ``make bench`` (``wan.py``: namespaces, SeaweedFS, the photo-like datasets, each run a
fresh process forked inside the client namespace), one section's dataset, one latency and order, the
readers named (a ``peers`` reader, with options: ``asyncload:read_mode=column,request_size=64``; or a
reader label of the config). Beside what ``peers.harness.measure_reader``
reports (samples/s, CPU and bytes per sample over the measured window, per-thread CPU, asyncload's stats),
a monitor thread here records over that window:

- CPU per sample of the server (``weed`` and its children) and of the two ``nfq_delay`` delay lines, and
  the machine's idle share (``/proc/stat``): is the 2-core machine saturated, and by whom;
- the client's TCP connections every 0.5 s (``ss -tin`` in the client namespace): how many, their
  congestion windows, RTT, bytes received and data segments sent (one per HTTP request: a count of requests);
- with ``--pyspy``, a py-spy profile of the client's Python threads (``--format raw``), summarised by
  function (py-spy slows the client: profile runs are for shares, never for throughput).

Writes ``<out>/<name>.json`` and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asyncload.runtime.settings import parse_overrides  # noqa: E402
from benchmarks.peers.harness import Runner, cpu_jiffies, proc_cpu_s, tree_cpu_s  # noqa: E402
from benchmarks.suites import wan  # noqa: E402
from benchmarks.testbeds import netem  # noqa: E402
from benchmarks.testbeds.world import world  # noqa: E402


def _pids_named(name: str) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/comm") as f:
                    if f.read().strip() == name:
                        out.append(int(d))
            except OSError:
                pass
    return out


_SS_FIELD = re.compile(
    r"\b(cwnd|rtt|bytes_received|bytes_acked|data_segs_out|rcv_space|unacked|delivery_rate|busy|rwnd_limited"
    r"|sndbuf_limited):([\d.]+)"
)


def ss(ns: str, peer: str | None = None) -> list[dict[str, float]]:
    """A namespace's established TCP connections (to ``peer`` only, if given) with the fields that
    matter here; ``app_limited`` is 1 where the sender had nothing to send when last measured."""
    argv = ["ip", "netns", "exec", ns, "ss", "-tinH", "state", "established"]
    if peer:
        argv += ["dst", peer]
    text = subprocess.run(argv, capture_output=True, text=True).stdout
    conns, cur = [], None
    for line in text.splitlines():
        if not line.startswith((" ", "\t")):
            cur = {}
            conns.append(cur)
            continue
        if cur is not None:
            for k, v in _SS_FIELD.findall(line):
                cur[k] = float(v)
            cur["app_limited"] = float("app_limited" in line)
    return [c for c in conns if c]


class Monitor:
    """Samples server, delay-line and machine CPU every 0.1 s and the client's sockets every 0.5 s."""

    def __init__(self, ns: str, server_ns: str, server_pid: int | None) -> None:
        self.ns = ns
        self.server_ns = server_ns
        self.server_pid = server_pid
        # unix time, weed, nfq_delay, machine busy, machine total, client tree (CPU seconds; jiffies for the machine)
        self.cpu: list[tuple[float, float, float, float, float, float]] = []
        self.client_pid: int | None = None
        self.sockets: list[tuple[float, list[dict[str, float]]]] = []
        self.server_sockets: list[tuple[float, list[dict[str, float]]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        nfq = _pids_named("nfq_delay")
        last_ss = 0.0
        while not self._stop.is_set():
            now = time.time()
            busy, total = cpu_jiffies()  # the whole machine
            nfq_s = sum(proc_cpu_s(p, reaped=True) for p in nfq)
            server, client = tree_cpu_s(self.server_pid, reaped=True), tree_cpu_s(self.client_pid, reaped=True)
            self.cpu.append((now, server, nfq_s, busy, total, client))
            if now - last_ss >= 0.5:
                last_ss = now
                self.sockets.append((now, ss(self.ns)))
                if self.server_ns:
                    self.server_sockets.append((now, ss(self.server_ns, netem.CLIENT_IP)))
            self._stop.wait(0.1)

    def start(self, pid: int) -> None:
        self.client_pid = pid
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def busy_after(self, t: float) -> dict[str, float] | None:
        """Cores busy on the machine, and the client's, from ``t`` (its first batch) to the last sample."""
        later = [c for c in self.cpu if c[0] >= t]
        if len(later) < 2:
            return None
        a, b = later[0], later[-1]
        ncpu, secs = os.cpu_count() or 1, b[0] - a[0]
        return {
            "machine": round((b[3] - a[3]) / max(1, b[4] - a[4]) * ncpu, 2),
            "client": round((b[5] - a[5]) / max(1e-9, secs), 2),
        }

    def window(self, t0: float, t1: float, samples: int) -> dict[str, Any]:
        """CPU per sample of server and delay lines, machine busy share, sockets: over ``[t0, t1]``
        (the run, from the child's start to its last sample), per ``samples`` (all it read)."""
        inside = [c for c in self.cpu if t0 <= c[0] <= t1]
        out: dict[str, Any] = {}
        if len(inside) >= 2:
            a, b = inside[0], inside[-1]
            out["server_cpu_ms_per_sample"] = 1e3 * (b[1] - a[1]) / samples
            out["delay_line_cpu_ms_per_sample"] = 1e3 * (b[2] - a[2]) / samples
            out["machine_busy_share"] = (b[3] - a[3]) / max(1, b[4] - a[4])
            # cores used over the interval by the client, the server, the delay lines and everything else on
            # the machine (other users' jobs, the kernel's own threads, this monitor)
            secs, ncpu = b[0] - a[0], os.cpu_count() or 1
            busy = out["machine_busy_share"] * ncpu
            mine = [(b[k] - a[k]) / max(1e-9, secs) for k in (5, 1, 2)]
            out["cores"] = {
                "client": round(mine[0], 2), "server": round(mine[1], 2), "delay_line": round(mine[2], 2),
                "other": round(busy - sum(mine), 2), "idle": round(ncpu - busy, 2),
            }  # fmt: skip
            out["window_covered_s"] = b[0] - a[0]
            # the per-sample figures above span the sampled part of the window only: rescale
            scale = (t1 - t0) / max(1e-9, b[0] - a[0])
            for k in ("server_cpu_ms_per_sample", "delay_line_cpu_ms_per_sample"):
                out[k] *= scale
        snaps = [s for t, s in self.sockets if t0 <= t <= t1] or [s for _, s in self.sockets[-1:]]
        if snaps:
            mid = snaps[len(snaps) // 2]
            last = max(self.sockets, key=lambda ts: sum(c.get("data_segs_out", 0) for c in ts[1]))[1]
            cw = [c["cwnd"] for c in mid if "cwnd" in c]
            out["connections_mid_window"] = len(mid)
            out["cwnd_mid_window"] = _dist(cw)
            out["rtt_ms_mid_window"] = _dist([c["rtt"] for c in mid if "rtt" in c])
            out["rcv_space_mid_window"] = _dist([c["rcv_space"] for c in mid if "rcv_space" in c])
            out["busy_connections_mid_window"] = sum(1 for c in mid if c.get("unacked", 0) or c.get("rcv_space", 0))
            out["requests_seen_by_ss"] = int(sum(c.get("data_segs_out", 0) for c in last))
        srv = [s for t, s in self.server_sockets if t0 <= t <= t1]
        if srv:
            conns = [c for snap in srv for c in snap]  # every connection at every sample in the window
            out["server_side"] = {
                "connections": _dist([float(len(snap)) for snap in srv]),
                "cwnd": _dist([c["cwnd"] for c in conns if "cwnd" in c]),
                "delivery_rate_mbit": _dist([c["delivery_rate"] / 1e6 for c in conns if "delivery_rate" in c]),
                "app_limited_share": round(statistics.fmean(c["app_limited"] for c in conns), 2) if conns else None,
                "unacked": _dist([c.get("unacked", 0.0) for c in conns]),
                "rwnd_limited_ms": _dist([c.get("rwnd_limited", 0.0) for c in conns]),
                "busy_ms": _dist([c.get("busy", 0.0) for c in conns]),
            }
            out["bytes_received_by_ss"] = int(sum(c.get("bytes_received", 0) for c in last))
        return out


def _dist(v: list[float]) -> dict[str, float] | None:
    if not v:
        return None
    v = sorted(v)
    return {"min": v[0], "p50": v[len(v) // 2], "max": v[-1], "mean": round(statistics.fmean(v), 1)}


def pyspy_summary(raw: Path, top: int = 25) -> dict[str, Any]:
    """py-spy's raw (collapsed) stacks: samples per thread kind, and the functions that take the most
    time themselves (leaf frames) and in total (anywhere on the stack)."""
    self_t: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        count = int(n)
        frames = stack.split(";")
        total += count
        threads[frames[0]] += count
        leaf = frames[-1]
        self_t[leaf] += count
        for f in set(frames[1:]):
            incl[f] += count
    pct = lambda c: {k: round(100 * v / max(1, total), 1) for k, v in c.most_common(top)}  # noqa: E731
    return {"samples": total, "threads": pct(threads), "self_pct": pct(self_t), "total_pct": pct(incl)}


def perf_summary(data: Path, client: int | None) -> dict[str, Any]:
    """CPU shares over a run from ``perf record -a`` (percent of every sample on the machine): by process
    (the client, ``weed``, ``nfq_delay``, idle, everything else), then the client's alone by thread name
    (Deep Lake's ``B_*`` threads folded into one), by thread and shared object, and its top symbols."""

    def report(*sort: str, pid: int | None = None) -> list[tuple[float, list[str]]]:
        argv = ["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", ",".join(sort), "-q"]
        if pid is not None:
            argv += ["--pid", str(pid)]
        text = subprocess.run(argv, capture_output=True, text=True).stdout
        rows = []
        for line in text.splitlines():
            parts = line.split()
            if parts and parts[0].endswith("%"):
                rows.append((float(parts[0][:-1]), parts[1:]))
        return rows

    by_comm: Counter[str] = Counter()
    for pct, rest in report("comm", pid=client):
        name = " ".join(rest)
        by_comm["B_* (deeplake)" if re.fullmatch(r"B_\d+", name) else name] += pct
    by_dso: Counter[str] = Counter()
    for pct, rest in report("comm", "dso", pid=client):
        comm = "B_*" if re.fullmatch(r"B_\d+", rest[0]) else rest[0]
        by_dso[f"{comm} {' '.join(rest[1:])}"] += pct
    syms = report("comm", "dso", "sym", pid=client)
    top = [(pct, " ".join(rest)) for pct, rest in syms[:60]]
    machine: Counter[str] = Counter()
    for pct, rest in report("comm"):
        machine[" ".join(rest)] += pct
    by_owner = {"client": sum(by_comm.values())}
    by_owner.update({k: machine.get(k, 0.0) for k in ("weed", "nfq_delay", "swapper")})
    by_owner["other"] = 100.0 - sum(by_owner.values())  # other users' jobs, kernel threads, this probe
    data.unlink(missing_ok=True)
    return {
        "by_process_pct": {("idle" if k == "swapper" else k): round(v, 1) for k, v in by_owner.items()},
        "client_by_thread_pct": {k: round(v, 1) for k, v in by_comm.most_common(25)},
        "client_by_thread_dso_pct": {k: round(v, 1) for k, v in by_dso.most_common(40)},
        "top_symbols_pct": top,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "bench_wan.yaml"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--rtt", type=int, default=50, help="ms")
    ap.add_argument("--order", default="shuffled", choices=["sequential", "shuffled"])
    ap.add_argument("--reader", action="append", default=[], help="peer name, or asyncload:opt=v,opt=v")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--section", type=int, default=0, help="the config section whose dataset is read")
    ap.add_argument("--pyspy", action="store_true")
    ap.add_argument(
        "--perf", action="store_true", help="perf record -a over each run (machine-wide, by thread and DSO)"
    )
    ap.add_argument("--name", default="probe")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wan" / "probe"))
    args = ap.parse_args(argv)
    scratch = tempfile.mkdtemp(prefix="wan-probe-")  # the suite writes its own results.json there
    cfg = wan.load_suite_config(args.config, [*args.set, f"out={scratch}"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = wan.Suite(cfg)
    section = bench.sections[args.section]
    readers = args.reader or ["asyncload", "column"]
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    runs: list[dict[str, Any]] = []
    with world(ROOT / cfg.data_dir, rate_mbit=cfg.rate_mbit, force_proxy=cfg.proxy) as w:
        net, server = w.net, w.server
        bench.prepare(w)
        run = Runner(cfg.run_timeout_s, enter=net.enter_client)
        w.set_rtt(args.rtt)
        ns = getattr(net, "ns", {}).get("client", "")
        for rep in range(args.reps):
            for reader in readers:
                kind, _, opts = reader.partition(":")
                any_label = next(iter(bench.readers))
                spec = bench.spec(w, section, args.rtt, args.order, reader if reader in bench.readers else any_label)
                if reader not in bench.readers:
                    spec["reader"] = kind
                    spec["options"] = dict(parse_overrides([o for o in opts.split(",") if o])) if opts else {}
                mon = Monitor(ns, getattr(net, "ns", {}).get("server", ""), server.pid)
                spy: subprocess.Popen[bytes] | None = None
                perf: subprocess.Popen[bytes] | None = None
                prof = out / f"{args.name}-{kind}-{rep}.pyspy.txt"
                perf_data = out / f"{args.name}-{kind}-{rep}.perf.data"

                def started(pid: int, mon: Monitor = mon, prof: Path = prof, perf_data: Path = perf_data) -> None:
                    nonlocal spy, perf
                    mon.start(pid)
                    if args.perf:
                        perf = subprocess.Popen(
                            ["perf", "record", "-a", "-F", "199", "-o", str(perf_data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        )  # fmt: skip
                    if args.pyspy:
                        spy = subprocess.Popen(
                            [pyspy, "record", "--pid", str(pid), "--rate", "100", "--format", "raw",
                             "--nonblocking", "--threads", "-o", str(prof)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        )  # fmt: skip

                m = run(spec, on_start=started)
                mon.stop()
                if perf is not None:
                    perf.send_signal(2)
                    perf.wait(60)
                    m["perf"] = perf_summary(perf_data, mon.client_pid)
                if spy is not None:
                    spy.wait(30)
                if "span_unix" in m and mon.cpu:  # the whole run, as the client's own CPU figure
                    m["monitor"] = mon.window(mon.cpu[0][0], m["span_unix"][1], m["samples"])
                    m["monitor"]["cores_after_first_batch"] = mon.busy_after(m["span_unix"][0])
                if args.pyspy and prof.exists():
                    m["pyspy"] = pyspy_summary(prof)
                runs.append({"reader": reader, "rep": rep, "m": m})
                _print(reader, m)
    doc = {
        "rtt_ms": args.rtt, "order": args.order, "network": net.describe() if hasattr(net, "describe") else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": runs,
    }  # fmt: skip
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=1, default=str))
    _summary(runs)
    return 0


def _print(reader: str, m: dict[str, Any]) -> None:
    if "error" in m:
        print(f"{reader}: {m['error']}", flush=True)
        return
    mon = m.get("monitor", {})
    print(
        f"{reader}: {m['run_samples_per_s']:.0f}/s open to last ({m['samples_per_s']:.0f} first batch to last, "
        f"first batch {m['first_batch_s']:.2f} s), cpu {m['cpu_ms_per_sample']:.2f} ms/sample, rx "
        f"{m['rx_bytes_per_sample'] / 1e3:.0f} KB/sample, server {mon.get('server_cpu_ms_per_sample', 0):.2f} ms, "
        f"delay line {mon.get('delay_line_cpu_ms_per_sample', 0):.2f} ms, busy {mon.get('machine_busy_share', 0):.2f}, "
        f"threads {m.get('thread_cpu_ms_per_sample')}, "
        + ", ".join(f"{k[10:]}={v}" for k, v in m.items() if k.startswith("asyncload_")),
        flush=True,
    )


_SUMMARY = {
    "samples/s open to last": lambda m: m["run_samples_per_s"],
    "first batch to last": lambda m: m["samples_per_s"],
    "first batch s": lambda m: m["first_batch_s"],
    "client CPU ms": lambda m: m["cpu_ms_per_sample"],
    "server ms": lambda m: m.get("monitor", {}).get("server_cpu_ms_per_sample", 0.0),
    "delay line ms": lambda m: m.get("monitor", {}).get("delay_line_cpu_ms_per_sample", 0.0),
    "machine busy": lambda m: m.get("monitor", {}).get("machine_busy_share", 0.0),
    "KB/sample": lambda m: m["rx_bytes_per_sample"] / 1e3,
}


def _summary(runs: list[dict[str, Any]]) -> None:
    """Medians per reader of the figures in ``_SUMMARY`` (CPU and bytes per sample over the whole run)."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        if "samples_per_s" in r["m"]:
            by[r["reader"]].append(r["m"])
    print("\nmedians:")
    for reader, ms in by.items():
        figures = ", ".join(f"{name} {statistics.median(f(m) for m in ms):.2f}" for name, f in _SUMMARY.items())
        print(f"  {reader} ({len(ms)} runs): {figures}")


if __name__ == "__main__":
    sys.exit(main())
