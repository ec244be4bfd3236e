"""Soak under random faults: a real training loop over SeaweedFS while a seeded injector breaks things.

    python -m benchmarks.suites.soak [--minutes 30] [--seed 1] [--rows 480] [--gap 8:30]
                                     [--stall 2:60] [--restart 2:15] [--out benchmarks/results/soak]

(``make soak`` runs the 30-minute soak.) What runs, and why this way:

- **The store**: a SeaweedFS S3 server on loopback (``harness.seaweed``), behind the fault proxy
  (``harness.faults.FaultProxy``, which answers the 503s and resets on cue and refuses connections while
  the server is down; it forwards everything else, and a SIGSTOPped server behind it is as silent to the
  client as a load balancer that keeps the connection). The data: ``--rows`` synthetic segmentation rows
  as a Deep Lake dataset (``s3://soak/seg``) and as PNG files (``s3://soak/files``).
- **The training loop**: a small convolutional model, one optimizer step per batch, over six loaders in
  turn, one epoch each: both sources (``DeepLakeSource`` and ``ObjectStoreSource`` on the proxy's s3) ×
  the three ways to read (``AsyncLoader`` with the defaults: a Deep Lake reader process; ``processes=2``:
  two fan-out workers; ``AsyncIterableDataset`` in ``DataLoader(num_workers=2)``, spawned, persistent).
  Every setting but ``batch_size`` and ``shuffle`` is asyncload's default (``stall_timeout`` 120 s).
- **The faults**, at random times from ``--seed`` (one every ``--gap`` seconds): the server SIGSTOPped
  for ``--stall`` seconds; killed and started again on its port after ``--restart`` seconds; a burst of
  50-300 503s; a burst of 20-100 resets mid-body; a SIGKILL of the live loader's reader process or of one
  of its fan-out workers. Each is logged with its start and end.
- **What is checked**: every epoch yields every row exactly once, or ends in a named asyncload error
  (``AsyncLoadError``: ``StallError``, ``ReadError``, ``WorkerError``...) and is read again, as a
  training script that catches it would, until an attempt is exact (at most ``--retries``); anything else
  is a failure. The RSS of the process tree (this process and its children, the server excluded) is
  sampled every 2 s and at every epoch end; at the end, after every loader is closed: no child process
  left but the server, no asyncload thread, no more file descriptors or sockets than before the first
  loader, no ``/dev/shm/torch_*`` file of this run's processes.
- **What each fault cost**: the seconds the training loop went without a batch beyond its usual rhythm,
  from the fault's start to 15 s after its end: every gap between batches there, less the run's 95th
  percentile gap (epoch ends and starts included), summed; reported per fault and per kind. A fault that
  found nothing to hit (no reader live) shows what noise this measure has.
- **Deep Lake keeps what it fetched**: a small dataset is read from memory after its first epoch in a
  process, where no fault reaches it. So every ``--rebuild`` rounds of the six loaders, all of them are
  closed and built again (as a supervisor that restarts a job would): new reader and worker processes
  open the dataset and read it cold, under the faults, and the leak checks see many loaders' lives.

It writes ``<out>/soak-<seed>-<minutes>min.json`` (every figure, the fault log, the memory curve) and a
``.md`` summary next to it, and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import logging
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, AsyncLoadError, DeepLakeSource, ObjectStoreSource
from asyncload.tools.synthetic import make_dataset, make_sample
from harness.faults import Fault, FaultProxy
from harness.seaweed import SeaweedServer

log = logging.getLogger("soak")
BUCKET = "soak"
HEIGHT = WIDTH = 48


# -- the data -----------------------------------------------------------------------------------------
def upload(server: SeaweedServer, rows: int) -> None:
    """The same rows as Deep Lake (``seg``) and as PNG files (``files/images``, ``files/masks``)."""
    import io
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    server.create_bucket(BUCKET)
    make_dataset(f"s3://{BUCKET}/seg", rows, height=HEIGHT, width=WIDTH, creds=server.creds(BUCKET), progress=False)

    def put(i: int) -> None:
        image, mask = make_sample(np.random.default_rng([0, i]), HEIGHT, WIDTH)
        for col, arr in (("images", image), ("masks", mask)):
            buf = io.BytesIO()
            Image.fromarray(arr).save(buf, format="PNG")
            server.put_object(BUCKET, f"files/{col}/{i:06d}.png", buf.getvalue())

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, range(rows)))


# -- the process tree -----------------------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return out


def tree(root: int, skip: set[int]) -> list[int]:
    """``root`` and its descendants, without the subtrees of ``skip``."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in skip:
            continue
        out.append(pid)
        todo += _children(pid)
    return out


def rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
                        break
        except OSError:
            continue
    return total / 1024


def fds() -> tuple[int, int]:
    """(file descriptors, of which sockets) of this process."""
    n = socks = 0
    for fd in os.listdir("/proc/self/fd"):
        n += 1
        try:
            socks += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            continue
    return n, socks


# -- faults -------------------------------------------------------------------------------------------
@dataclass
class FaultEvent:
    kind: str
    start: float  # seconds since the soak began
    end: float | None = None
    detail: str = ""
    cost_s: float = 0.0


class Injector:
    """Seeded faults, one every ``gap`` seconds, on its own thread; every fault ends by ``stop()``."""

    def __init__(self, server: SeaweedServer, proxy: FaultProxy, seed: int, t0: float, args: argparse.Namespace,
                 victims: Any) -> None:  # fmt: skip
        self.server, self.proxy, self.rng, self.t0, self.args = server, proxy, random.Random(seed), t0, args
        self.victims = victims  # () -> pids of the live loader's reader or fan-out processes
        self.events: list[FaultEvent] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-faults", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        self._heal()

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _heal(self) -> None:
        """The server running and answering, the proxy up, no rule left."""
        pid = self.server.pid
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        self.server.start()
        self.proxy.schedule.clear()

    def _wait(self, seconds: float) -> bool:
        return self._stop.wait(seconds)

    def _run(self) -> None:
        lo, hi = self.args.gap
        kinds = ["sigstop", "kill_restart", "burst_503", "burst_reset", "kill_reader"]
        weights = [3, 2, 2, 2, 3]
        while not self._wait(self.rng.uniform(lo, hi)):
            kind = self.rng.choices(kinds, weights)[0]
            ev = FaultEvent(kind, self._now())
            try:
                self._inject(kind, ev)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be made is recorded, then healed
                ev.detail += f" (injector error: {type(exc).__name__}: {exc})"
                self._heal()
            ev.end = ev.end if ev.end is not None else self._now()
            self.events.append(ev)
            log.warning("fault %s at %.1f s for %.1f s %s", ev.kind, ev.start, ev.end - ev.start, ev.detail)

    def _inject(self, kind: str, ev: FaultEvent) -> None:
        if kind == "sigstop":
            seconds = self.rng.uniform(*self.args.stall)
            pid = self.server.pid
            assert pid is not None
            os.killpg(pid, signal.SIGSTOP)
            try:
                self._wait(seconds)
            finally:
                os.killpg(pid, signal.SIGCONT)
            ev.detail = f"server stopped {seconds:.1f} s"
        elif kind == "kill_restart":
            seconds = self.rng.uniform(*self.args.restart)
            self.proxy.schedule.down(refuse=True)  # as a dead server: connections refused
            self.server.stop(kill=True)
            self._wait(seconds)
            self.server.start()
            self.proxy.schedule.up()
            ev.detail = f"server killed, back after {self._now() - ev.start:.1f} s"
        elif kind in ("burst_503", "burst_reset"):
            n = self.rng.randint(50, 300) if kind == "burst_503" else self.rng.randint(20, 100)
            fault = Fault.HTTP_503 if kind == "burst_503" else Fault.RESET
            rule = self.proxy.schedule.burst(fault, n, match=f"/{BUCKET}/")
            end = time.monotonic() + 60
            while rule.hits < n and time.monotonic() < end and not self._stop.is_set():
                self._wait(0.1)
            self.proxy.schedule.remove(rule)
            ev.detail = f"{rule.hits} of {n} {fault.value}"
        elif kind == "kill_reader":
            pids = self.victims()
            if not pids:
                ev.detail = "no reader or worker process live"
                return
            pid = self.rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
                ev.detail = f"SIGKILL pid {pid}"
            except ProcessLookupError:
                ev.detail = f"pid {pid} already gone"


# -- the training loop ------------------------------------------------------------------------------------
class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.b = torch.nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x)))


@dataclass
class EpochRecord:
    epoch: int
    loader: str
    attempts: int
    seconds: float
    errors: list[str] = field(default_factory=list)
    exact: bool = False
    rss_mb: float = 0.0


def make_loaders(endpoint: dict[str, str], batch: int) -> dict[str, Any]:
    """The six ways to read, built once and kept across epochs (as a training script keeps its loader)."""
    def deeplake() -> DeepLakeSource:
        return DeepLakeSource(f"s3://{BUCKET}/seg", creds=endpoint)

    def files() -> ObjectStoreSource:
        return ObjectStoreSource(f"s3://{BUCKET}/files", creds=endpoint)

    out: dict[str, Any] = {}
    for name, make in (("deeplake", deeplake), ("objectstore", files)):
        out[f"{name}/defaults"] = AsyncLoader(make(), batch, shuffle=True)
        out[f"{name}/processes=2"] = AsyncLoader(make(), batch, shuffle=True, processes=2)
        ds = AsyncIterableDataset(make(), batch, shuffle=True)
        dl = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="spawn")
        out[f"{name}/dataloader-workers"] = (ds, dl)
    return out


#: multiprocessing's own helper processes (one each for the whole interpreter's life), not a loader's
HELPERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"


def close_all(loaders: dict[str, Any]) -> None:
    for loader in loaders.values():
        if isinstance(loader, tuple):
            ds, dl = loader
            it = getattr(dl, "_iterator", None)
            if it is not None:
                it._shutdown_workers()  # persistent workers: DataLoader has no public close
            ds.close()
        else:
            loader.close()


def epoch_of(loader: Any, epoch: int) -> Any:
    if isinstance(loader, tuple):
        ds, dl = loader
        ds.set_epoch(epoch)
        return iter(dl)
    loader.set_epoch(epoch)
    return iter(loader)


def victims_of(loader: Any) -> list[int]:
    """The live reader or fan-out processes of ``loader`` (none for the DataLoader workers' epochs: there
    each worker is the isolation, and torch reports a killed worker itself)."""
    if isinstance(loader, tuple):
        return []
    pids: list[int] = []
    iso = getattr(loader, "_isolated", None)
    if iso is not None and iso.pid is not None:
        pids.append(iso.pid)
    pool = getattr(loader, "_pool", None)
    if pool is not None and not pool.closed:
        pids += list(pool.pids.values())
    return [p for p in pids if os.path.exists(f"/proc/{p}")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rows", type=int, default=480)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--gap", type=lambda s: tuple(map(float, s.split(":"))), default=(8.0, 30.0))
    p.add_argument("--stall", type=lambda s: tuple(map(float, s.split(":"))), default=(2.0, 60.0))
    p.add_argument("--restart", type=lambda s: tuple(map(float, s.split(":"))), default=(2.0, 15.0))
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--rebuild", type=int, default=4, help="rounds of the six loaders between rebuilds")
    p.add_argument("--hang-s", type=float, default=300.0, help="an epoch attempt longer than this is a hang")
    p.add_argument("--out", default="benchmarks/results/soak")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    work = Path(tempfile.mkdtemp(prefix="asyncload-soak-"))
    server = SeaweedServer(work / "seaweed")
    server.start()
    failures: list[str] = []
    records: list[EpochRecord] = []
    curve: list[tuple[float, float]] = []
    batch_times: list[float] = []
    t0 = time.monotonic()
    try:
        upload(server, args.rows)
        gc.collect()
        fds_before, socks_before = fds()  # (before the proxy, which is stopped before they are counted again)
        proxy = FaultProxy(("127.0.0.1", server.port), upstream_timeout=600.0)
        proxy.start()
        endpoint = dict(server.creds(BUCKET), endpoint_url=proxy.url)
        loaders = make_loaders(endpoint, args.batch_size)
        names = list(loaders)
        live: dict[str, Any] = {"loader": None}
        injector = Injector(server, proxy, args.seed, t0, args, lambda: victims_of(live["loader"]))
        sampling = threading.Event()

        def sample() -> None:
            while not sampling.wait(2.0):
                skip = {server.pid} if server.pid else set()
                curve.append((time.monotonic() - t0, rss_mb(tree(os.getpid(), skip))))

        sampler = threading.Thread(target=sample, name="soak-rss", daemon=True)
        sampler.start()
        model = Model()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        injector.start()
        end = t0 + args.minutes * 60
        epoch = rebuilds = 0
        while time.monotonic() < end:
            if epoch and epoch % (len(names) * args.rebuild) == 0:  # cold readers again (module doc)
                live["loader"] = None
                close_all(loaders)
                loaders = make_loaders(endpoint, args.batch_size)
                rebuilds += 1
            name = names[epoch % len(names)]
            loader = live["loader"] = loaders[name]
            rec = EpochRecord(epoch, name, 0, 0.0)
            e0 = time.monotonic()
            # A hang is a failure too: every thread's stack, then exit 1 (not a soak that never ends).
            faulthandler.dump_traceback_later(args.hang_s * (args.retries + 1), exit=True)
            while True:
                rec.attempts += 1
                seen: list[int] = []
                try:
                    for b in epoch_of(loader, epoch):
                        x = b["images"].permute(0, 3, 1, 2).float() / 255
                        y = b["masks"].long().clamp_(0, 3)
                        loss = F.cross_entropy(model(x), y)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        seen += b["index"].tolist()
                        batch_times.append(time.monotonic() - t0)
                except AsyncLoadError as exc:
                    rec.errors.append(f"{type(exc).__name__}: {str(exc)[:300]}")
                    if rec.attempts > args.retries:
                        failures.append(f"epoch {epoch} ({name}): still failing after {args.retries} retries")
                        break
                    continue
                except Exception as exc:  # noqa: BLE001 - not a named error: a failure of the soak
                    rec.errors.append(f"UNNAMED {type(exc).__name__}: {str(exc)[:300]}")
                    failures.append(f"epoch {epoch} ({name}): {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                    if rec.attempts > args.retries:
                        break
                    continue
                counts = Counter(seen)
                rec.exact = sorted(counts) == list(range(args.rows)) and max(counts.values()) == 1
                if not rec.exact:
                    lost = sorted(set(range(args.rows)) - set(counts))
                    twice = sorted(i for i, c in counts.items() if c > 1)
                    failures.append(f"epoch {epoch} ({name}): not exactly once: lost {lost[:10]}, repeated {twice[:10]}")
                break
            faulthandler.cancel_dump_traceback_later()
            rec.seconds = time.monotonic() - e0
            rec.rss_mb = rss_mb(tree(os.getpid(), {server.pid} if server.pid else set()))
            records.append(rec)
            print(f"[{time.monotonic() - t0:7.1f}s] epoch {epoch} {name}: {rec.seconds:.1f} s, attempts "
                  f"{rec.attempts}, exact {rec.exact}, rss {rec.rss_mb:.0f} MB{'; ' + rec.errors[-1] if rec.errors else ''}",
                  flush=True)  # fmt: skip
            epoch += 1
        live["loader"] = None
        injector.stop()
        sampling.set()
        sampler.join(5)
        # -- the end: everything closed, nothing left behind -------------------------------------------
        close_all(loaders)
        del loaders, loader
        gc.collect()
        time.sleep(2.0)
        proxy.stop()  # (its own sockets: both ends of every connection it relayed)
        kids = [c for c in tree(os.getpid(), {server.pid} if server.pid else set()) if c != os.getpid()]
        helpers = [c for c in kids if any(h in cmdline(c) for h in HELPERS)]
        left_children = [f"{c}: {cmdline(c)[:120]}" for c in kids if c not in helpers]
        left_threads = [t.name for t in threading.enumerate() if t.name.startswith("asyncload")]
        fds_after, socks_after = fds()
        shm = [n for n in os.listdir("/dev/shm") if n.startswith("torch_")] if os.path.isdir("/dev/shm") else []
        leaks = {
            "children": left_children, "python_helpers": [f"{c}: {cmdline(c)[:80]}" for c in helpers],
            "asyncload_threads": left_threads, "fds": [fds_before, fds_after],
            "sockets": [socks_before, socks_after], "torch_shm": shm, "rebuilds": rebuilds,
        }  # fmt: skip
        if left_children:
            failures.append(f"child processes left: {left_children}")
        if left_threads:
            failures.append(f"asyncload threads left: {left_threads}")
        if socks_after > socks_before:
            failures.append(f"sockets: {socks_before} before the loaders, {socks_after} after closing them")
        if fds_after > fds_before + 2:
            failures.append(f"file descriptors: {fds_before} before the loaders, {fds_after} after closing them")
    finally:
        server.close()
    # -- what each fault cost ----------------------------------------------------------------------------
    gaps = np.diff(batch_times) if len(batch_times) > 2 else np.array([0.0])
    usual = float(np.median(gaps)) if len(gaps) else 0.0
    rhythm = float(np.percentile(gaps, 95)) if len(gaps) else 0.0  # a gap this long is the loop's own rhythm
    for ev in injector.events:
        lo, hi = ev.start, (ev.end or ev.start) + 15.0
        ev.cost_s = float(sum(g - rhythm for t, g in zip(batch_times[:-1], gaps, strict=False)
                              if lo - 1.0 <= t <= hi and g > rhythm))  # fmt: skip
    by_kind: dict[str, dict[str, float]] = {}
    for ev in injector.events:
        k = by_kind.setdefault(ev.kind, {"count": 0, "cost_s": 0.0})
        k["count"] += 1
        k["cost_s"] += ev.cost_s
    errors = Counter(e.split(":")[0] for r in records for e in r.errors)
    warm = [r.rss_mb for r in records[6:]] if len(records) > 8 else [r.rss_mb for r in records]
    summary = {
        "seed": args.seed, "minutes": args.minutes, "rows": args.rows, "batch_size": args.batch_size,
        "gap_s": args.gap, "stall_s": args.stall, "restart_s": args.restart,
        "epochs": len(records), "exact_epochs": sum(r.exact for r in records),
        "retried_epochs": sum(r.attempts > 1 for r in records), "errors": dict(errors),
        "faults": by_kind, "fault_log": [asdict(e) for e in injector.events],
        "batches": len(batch_times), "median_gap_between_batches_s": usual,
        "rss_mb_epoch_ends": [round(r.rss_mb, 1) for r in records],
        "rss_mb_after_warmup": [min(warm), max(warm)] if warm else None,
        "rss_curve": [(round(t, 1), round(m, 1)) for t, m in curve],
        "leaks": leaks, "epochs_log": [asdict(r) for r in records], "failures": failures,
        "command": " ".join([sys.executable, "-m", "benchmarks.suites.soak", *(argv or sys.argv[1:])]),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"soak-{args.seed}-{args.minutes:g}min"
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    stem.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))
    return 1 if failures else 0


def markdown(s: dict[str, Any]) -> str:
    lines = [
        f"# Soak: {s['minutes']:g} min, seed {s['seed']}",
        "",
        f"`{s['command']}`",
        "",
        f"- epochs: {s['epochs']} ({s['exact_epochs']} exactly once; {s['retried_epochs']} read again after a "
        f"named error); batches {s['batches']}, usual gap between batches {s['median_gap_between_batches_s']:.3f} s",
        f"- errors (each followed by a retried epoch): {s['errors'] or 'none'}",
        f"- RSS of the process tree at epoch ends after the first 6 epochs: {s['rss_mb_after_warmup']} MB "
        f"(all: {s['rss_mb_epoch_ends']})",
        f"- left at the end: {s['leaks']}",
        f"- failures: {len(s['failures'])}",
        "",
        "| fault | count | seconds of training it cost (sum) |",
        "|---|---|---|",
    ]
    lines += [f"| {k} | {v['count']:g} | {v['cost_s']:.1f} |" for k, v in sorted(s["faults"].items())]
    lines += ["", "| t (s) | fault | lasted (s) | what | cost (s) |", "|---|---|---|---|---|"]
    lines += [f"| {e['start']:.1f} | {e['kind']} | {(e['end'] or e['start']) - e['start']:.1f} | {e['detail']} | "
              f"{e['cost_s']:.1f} |" for e in s["fault_log"]]  # fmt: skip
    if s["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f[:500]}" for f in s["failures"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
