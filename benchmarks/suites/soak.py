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
- **What each fault cost**: each epoch's seconds beyond the median of the same loader's epochs that no
  fault touched, shared among the faults whose window (start to 5 s after the end) overlaps that epoch,
  retries and their waits included; summed per fault and per kind. (Rebuilds are outside epochs.)
- **Deep Lake keeps what it fetched**: a small dataset is read from memory after its first epoch in a
  process, where no fault reaches it. So every ``--rebuild`` rounds of the six loaders, all of them are
  closed and built again (as a supervisor that restarts a job would): new reader and worker processes
  open the dataset and read it cold, under the faults, and the leak checks see many loaders' lives.

It writes ``<out>/soak-<seed>-<minutes>min.json`` (every figure, the fault log, the memory curve) and a
``.md`` summary next to it, and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import contextlib
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
SOURCES = ("deeplake", "objectstore")
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


def fd_targets() -> list[str]:
    """What each of this process's open descriptors refers to (``/proc/self/fd``: ``socket:[inode]``,
    ``pipe:[...]``, a path); one closed meanwhile is left out."""
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return targets


def socket_kinds() -> dict[str, int]:
    """This process's sockets by kind (``/proc/net``): TCP ones are connections (to the store, or its
    proxy); unix ones include multiprocessing's helpers' (the forkserver's, the resource tracker's)."""
    inodes = [t[8:-1] for t in fd_targets() if t.startswith("socket:[")]
    kinds: dict[str, int] = {}
    for table in ("tcp", "tcp6", "unix"):
        try:
            with open(f"/proc/net/{table}") as f:
                text = f.read()
        except OSError:
            continue
        known = {line.split()[9 if table != "unix" else 6] for line in text.splitlines()[1:] if line.split()}
        n = sum(i in known for i in inodes)
        if n:
            kinds[table] = n
    return kinds


def owners() -> dict[str, Any]:
    """What holds this process's descriptors, to name a leak's owner: each TCP connection (its ports and
    state, from ``/proc/net/tcp``), the other descriptors by kind (pipes, eventfds, epoll, io_uring,
    files), and the live objects that own connections: aiohttp sessions not closed, Deep Lake datasets."""
    import collections

    targets = fd_targets()
    inodes = {t[8:-1] for t in targets if t.startswith("socket:[")}
    import socket as _socket

    python_owned = set()  # the inodes of sockets a Python socket object holds (asyncio's default loop)
    for obj in gc.get_objects():
        if issubclass(type(obj), _socket.socket) and obj.fileno() >= 0:
            try:
                python_owned.add(os.readlink(f"/proc/self/fd/{obj.fileno()}")[8:-1])
            except OSError:
                continue
    tcp = []
    states = {"01": "ESTABLISHED", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN", "07": "CLOSE"}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) > 9 and parts[9] in inodes:
                local, remote = (int(a.rsplit(":", 1)[1], 16) for a in parts[1:3])
                held = "python" if parts[9] in python_owned else "native (uvloop or Deep Lake)"
                tcp.append(f"{local}->{remote} {states.get(parts[3], parts[3])} {held}")
    kinds = collections.Counter(
        t.split("[")[0].rstrip(":") if not t.startswith("/") else "file:" + os.path.dirname(t)
        for t in targets if not t.startswith("socket:")
    )  # fmt: skip
    import aiohttp

    sessions = deeplake_datasets = 0
    for obj in gc.get_objects():
        if type(obj) is aiohttp.ClientSession:  # (isinstance would ask lazy modules for __class__)
            sessions += not obj.closed
            continue
        module = getattr(type(obj), "__module__", None)  # (some extension types have none)
        if isinstance(module, str) and module.startswith("deeplake") and "Dataset" in type(obj).__name__:
            deeplake_datasets += 1
    return {"tcp": sorted(tcp), "other_fds": dict(kinds), "open_aiohttp_sessions": sessions,
            "deeplake_datasets": deeplake_datasets}  # fmt: skip


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
        """End the faults and heal what the last one broke; once (later calls do nothing)."""
        if self._stop.is_set():
            return
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
    span: tuple[float, float] = (0.0, 0.0)  # seconds since the soak began


def make_loaders(endpoint: dict[str, str], batch: int, sources: tuple[str, ...] = SOURCES) -> dict[str, Any]:
    """The six ways to read (three per source of ``sources``), built once and kept across epochs (as a
    training script keeps its loader)."""

    def deeplake() -> DeepLakeSource:
        return DeepLakeSource(f"s3://{BUCKET}/seg", creds=endpoint)

    def files() -> ObjectStoreSource:
        return ObjectStoreSource(f"s3://{BUCKET}/files", creds=endpoint)

    # The defaults but the node block store: with it every epoch after a round's first reads local disk, and
    # the faults would never reach a read (the store is soaked through its first epochs and its own tests).
    kw: dict[str, Any] = {"shuffle": True, "cache": False}
    out: dict[str, Any] = {}
    try:
        for name, make in [(n, m) for n, m in (("deeplake", deeplake), ("objectstore", files)) if n in sources]:
            out[f"{name}/defaults"] = AsyncLoader(make(), batch, **kw)
            out[f"{name}/processes=2"] = AsyncLoader(make(), batch, processes=2, **kw)
            ds = AsyncIterableDataset(make(), batch, **kw)
            dl = DataLoader(
                ds, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context="spawn"
            )
            out[f"{name}/dataloader-workers"] = (ds, dl)
    except BaseException:
        close_all(out)
        raise
    return out


def build(
    endpoint: dict[str, str],
    batch: int,
    errors: list[str],
    sources: tuple[str, ...] = SOURCES,
    deadline_s: float = 300.0,
) -> dict[str, Any]:
    """``make_loaders``, again while it meets a named error: an open fails fast (a 5 s probe) while the store
    is down, as a supervisor that rebuilds a job would see; each such failure is recorded."""
    end = time.monotonic() + deadline_s
    while True:
        try:
            return make_loaders(endpoint, batch, sources)
        except AsyncLoadError as exc:
            errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            if time.monotonic() > end:
                raise
            time.sleep(2.0)


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
    p.add_argument("--retries", type=int, default=5, help="retries of an epoch after a named error (2, 4, 8 s...)")
    p.add_argument("--rebuild", type=int, default=4, help="rounds of the six loaders between rebuilds")
    p.add_argument("--hang-s", type=float, default=300.0, help="an epoch attempt longer than this is a hang")
    p.add_argument("--out", default="benchmarks/results/soak")
    p.add_argument("--sources", type=lambda v: tuple(v.split(",")), default=SOURCES,
                   help="which sources' loaders to soak (a leak hunt narrows it down)")  # fmt: skip
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
    injector: Injector | None = None
    leaks: dict[str, Any] = {}
    build_errors: list[str] = []
    try:
        upload(server, args.rows)
        gc.collect()
        fds_before, socks_before = fds()  # (before the proxy, which is stopped before they are counted again)
        owned_before = owners()
        proxy = FaultProxy(("127.0.0.1", server.port), upstream_timeout=600.0)
        proxy.start()
        endpoint = dict(server.creds(BUCKET), endpoint_url=proxy.url)
        loaders = build(endpoint, args.batch_size, build_errors, args.sources)
        names = list(loaders)
        live: dict[str, Any] = {"loader": None, "all": loaders}
        injector = Injector(
            server, proxy, args.seed, t0, args,
            lambda: [p for ld in list(live["all"].values()) for p in victims_of(ld)],
        )  # fmt: skip
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
        fds_round: tuple[int, int] | None = None
        while time.monotonic() < end:
            if epoch and epoch % (len(names) * args.rebuild) == 0:  # cold readers again (module doc)
                live["loader"] = None
                close_all(loaders)
                live["all"] = {}
                if fds_round is None:  # the first round's loaders closed: the baseline for "nothing leaked"
                    gc.collect()
                    fds_round = fds()
                loaders = live["all"] = build(endpoint, args.batch_size, build_errors, args.sources)
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
                    time.sleep(min(30.0, 2.0**rec.attempts))  # as a training script retries: not at once
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
                    failures.append(
                        f"epoch {epoch} ({name}): not exactly once: lost {lost[:10]}, repeated {twice[:10]}"
                    )
                break
            faulthandler.cancel_dump_traceback_later()
            rec.seconds = time.monotonic() - e0
            rec.span = (e0 - t0, time.monotonic() - t0)
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
        # Nothing of the soak's own may keep a loader or a batch alive when the leftovers are counted: the
        # injector's view of the loaders (a closed loader keeps its opened source, and a Deep Lake
        # dataset its idle connections), the last batch and what the model made of it (a batch from a
        # worker holds its shared memory's descriptor).
        live["all"], live["loader"] = {}, None
        del loaders, loader
        b = x = y = loss = None  # noqa: F841 - released
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
            "fds_after_the_first_round": list(fds_round) if fds_round else None,
            "sockets": [socks_before, socks_after], "torch_shm": shm, "rebuilds": rebuilds,
        }  # fmt: skip
        if left_children:
            failures.append(f"child processes left: {left_children}")
        if left_threads:
            failures.append(f"asyncload threads left: {left_threads}")
        kinds = leaks["socket_kinds"] = socket_kinds()
        leaks["owners"], leaks["owners_before"] = owners(), owned_before
        leaks["ports"] = {"server": server.port, "proxy": proxy.port}
        tcp = kinds.get("tcp", 0) + kinds.get("tcp6", 0)
        if tcp:  # a connection left open: a session not closed (unix ones: multiprocessing's helpers)
            failures.append(f"TCP sockets left after closing every loader and the proxy: {kinds}")
        # multiprocessing's forkserver and resource tracker start with the first loaders and keep a pipe
        # each here for the process's life: judged from the end of the first round of loaders, when a
        # rebuild happened.
        if fds_after - socks_after > fds_before - socks_before + 4:  # (+4: the helpers' pipes)
            failures.append(f"file descriptors other than sockets: {fds_before - socks_before} before the loaders, "
                            f"{fds_after - socks_after} after closing them")  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the soak itself broke: a failure, reported with what was seen
        failures.append(f"the soak stopped: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if injector is not None:
            injector.stop()
        server.close()
    events = injector.events if injector is not None else []
    # -- what each fault cost ----------------------------------------------------------------------------
    gaps = np.diff(batch_times) if len(batch_times) > 2 else np.array([0.0])
    usual = float(np.median(gaps)) if len(gaps) else 0.0

    # An epoch's excess: its seconds less the median of its loader's epochs that no fault touched, shared
    # among the faults whose window (start to 5 s after the end) overlaps it.
    def touched(r: EpochRecord) -> list[FaultEvent]:
        return [e for e in events if e.start <= r.span[1] and (e.end or e.start) + 5.0 >= r.span[0]]

    calm: dict[str, list[float]] = {}
    for r in records:
        if not touched(r) and not r.errors:
            calm.setdefault(r.loader, []).append(r.seconds)
    for r in records:
        hit = touched(r)
        if not hit:
            continue
        if r.loader not in calm:  # no epoch of that loader to compare with: unknown, not 0
            for e in hit:
                e.cost_s = float("nan")
            continue
        excess = max(0.0, r.seconds - statistics.median(calm[r.loader]))
        for e in hit:
            e.cost_s += excess / len(hit)
    by_kind: dict[str, dict[str, float]] = {}
    for ev in events:
        k = by_kind.setdefault(ev.kind, {"count": 0, "cost_s": 0.0, "cost_unknown": 0})
        k["count"] += 1
        if ev.cost_s == ev.cost_s:  # (NaN: unknown)
            k["cost_s"] += ev.cost_s
        else:
            k["cost_unknown"] += 1
            ev.cost_s = None  # type: ignore[assignment]
    errors = Counter(e.split(":")[0] for r in records for e in r.errors)
    warm = [r.rss_mb for r in records[6:]] if len(records) > 8 else [r.rss_mb for r in records]
    summary = {
        "seed": args.seed, "minutes": args.minutes, "rows": args.rows, "batch_size": args.batch_size,
        "gap_s": args.gap, "stall_s": args.stall, "restart_s": args.restart,
        "epochs": len(records), "exact_epochs": sum(r.exact for r in records),
        "retried_epochs": sum(r.attempts > 1 for r in records), "errors": dict(errors),
        "faults": by_kind, "fault_log": [asdict(e) for e in events],
        "batches": len(batch_times), "median_gap_between_batches_s": usual,
        "rss_mb_epoch_ends": [round(r.rss_mb, 1) for r in records],
        "rss_mb_round_ends": [round(r.rss_mb, 1) for r in records if (r.epoch + 1) % (6 * args.rebuild) == 0],
        "rss_mb_after_warmup": [min(warm), max(warm)] if warm else None,
        "rss_curve": [(round(t, 1), round(m, 1)) for t, m in curve],
        "leaks": leaks, "epochs_log": [asdict(r) for r in records], "failures": failures,
        "build_errors": build_errors,
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
        f"- loaders built {s['leaks'].get('rebuilds', 0) + 1} times; builds that met a named error (and were "
        f"tried again 2 s later): {len(s['build_errors'])} {sorted(set(e.split(':')[0] for e in s['build_errors']))}",
        f"- RSS of the process tree at the end of each round of loaders (just before they are rebuilt): "
        f"{s['rss_mb_round_ends']} MB",
        f"- RSS of the process tree at epoch ends after the first 6 epochs: {s['rss_mb_after_warmup']} MB "
        f"(all: {s['rss_mb_epoch_ends']})",
        f"- left at the end: {s['leaks']}",
        f"- failures: {len(s['failures'])}",
        "",
        "| fault | count | seconds of training it cost (sum) | faults whose cost is unknown |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {k} | {v['count']:g} | {v['cost_s']:.1f} | {v['cost_unknown']:g} |" for k, v in sorted(s["faults"].items())
    ]
    lines += ["", "| t (s) | fault | lasted (s) | what | cost (s) |", "|---|---|---|---|---|"]
    lines += [f"| {e['start']:.1f} | {e['kind']} | {(e['end'] or e['start']) - e['start']:.1f} | {e['detail']} | "
              f"{'?' if e['cost_s'] is None else format(e['cost_s'], '.1f')} |" for e in s["fault_log"]]  # fmt: skip
    if s["failures"]:
        lines += ["", "## Failures", ""] + [f"- {f[:500]}" for f in s["failures"]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
