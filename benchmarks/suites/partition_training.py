"""Does the node-stable order (``shuffle_scope="node"``, the default) train as well as a global shuffle?
The U-Net of ``shuffle_training`` on its clip-ordered rows, read as a world of 2, 4 and 8 simulated nodes
would read them, against ``shuffle_scope="global"`` and a full shuffle; held-out mIoU side by side.

    nice -n 19 .venv/bin/python benchmarks/suites/partition_training.py [--epochs 4] [--seeds 0 1 2] \
        [--configs node2x4 node4x2 node8x1 global-w8 full-w8] [--merge JSON] [--out benchmarks/results/partition]

Why a simulated world. DistributedDataParallel averages the ranks' gradients, so one step of a world of
``W`` ranks is one step on the concatenation of the ranks' batches. Here every rank's sampler is the one
``AsyncLoader`` builds (``LoaderOptions.sampler`` under the rank's torchrun variables, so the node count
comes from ``nodes.node_count`` as in a real job, checked against the count asked for), and step ``k``
trains on rank 0's batch ``k``, then rank 1's, ... concatenated: one process, the world's order exactly.

Why each node-stable world is compared with a global one of the same size. A global batch of ``W``
ranks' batches draws from ``W`` places in the epoch's order, so the world's size mixes batches as the
shuffle does. To change nothing but the nodes, the default configurations are one world of ``W = 8``
ranks (4 rows each, a global batch of 32 as in ``shuffle_training``): 2 nodes × 4 ranks (``node2x4``),
4 × 2 and 8 × 1 with ``shuffle_scope="node"``, the same 8 ranks with ``shuffle_scope="global"``
(``global-w8``) and a full shuffle (``full-w8``, ``shuffle_block=1``); other worlds are named the same
way (``node2x2`` against ``global-w4``, ...), and the verdict pairs each node-stable world with the
global order of its own size. The node and global orders are the block order of ``shuffle_training``
(block 16 / window 256, the Deep Lake default's shape scaled to 1,536 rows).

Why in memory. The order is the question, not the reading: the 1,920 rows (48 px) are read once with
``AsyncLoader`` in storage order into tensors, and each global batch is taken from them by index, so
that 15 runs fit a shared 2-core machine. Everything but the order is ``shuffle_training``'s: rows
(``make_data``, made once under ``data/bench/``), model (``UNet``, width 16), Adam lr 3e-3, epochs,
``train_step``, and per seed the weights' initialisation and the loader's seed. The configurations'
runs alternate (seed by seed), so all meet the same load.

Writes ``training_quality.md`` and ``.json`` under ``--out`` after every run (a cut-short experiment keeps
what finished); ``--from-json`` rewrites the report without training.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asyncload import AsyncLoader  # noqa: E402
from asyncload.engine.options import LoaderOptions  # noqa: E402
from asyncload.engine.sampler import EpochSampler, Shard  # noqa: E402
from asyncload.sources.deeplake import DeepLakeSource  # noqa: E402
from asyncload.tools.train import StepOptions, UNet, train_step  # noqa: E402
from asyncload.tools.train.steps import iou_counts  # noqa: E402
from benchmarks.suites.shuffle_training import CLASS_NAMES, DATA_SEED, Run, Settings, make_data, summary  # noqa: E402
from benchmarks.testbeds.photos import PHOTOS  # noqa: E402

#: The torchrun variables ``nodes.node_count`` reads; set per simulated rank while its sampler is built.
TORCHRUN_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "RANK", "LOCAL_RANK")


@dataclass(frozen=True)
class Config:
    """One way of reading the epochs: a scope, the world (nodes × ranks per node) and the shuffle's block.

    Named ``node{N}x{R}`` (``shuffle_scope="node"``, N nodes of R ranks), ``global-w{W}``
    (``shuffle_scope="global"``, W ranks) or ``full-w{W}`` (``shuffle_block=1``, W ranks)."""

    name: str
    scope: str  # "node" or "global"
    nodes: int
    world: int
    block: int
    window: int

    @classmethod
    def parse(cls, name: str, s: Settings) -> Config:
        """The configuration a name stands for (the class doc); the block order is ``s.block`` / ``s.window``."""
        try:
            if name.startswith("node"):
                n, r = (int(v) for v in name[4:].split("x"))
                return cls(name, "node", n, n * r, s.block, s.window)
            kind, w = name.split("-w")
            if kind in ("global", "full"):
                return cls(name, "global", 1, int(w), s.block if kind == "global" else 1, s.window)
        except ValueError:
            pass
        raise SystemExit(f"configuration {name!r}: expected node<N>x<R>, global-w<W> or full-w<W>")

    @property
    def label(self) -> str:
        """How the report names it."""
        if self.block == 1:
            return f"full shuffle (`shuffle_block=1`), {self.world} ranks"
        if self.scope == "global":
            return f'`shuffle_scope="global"`, {self.world} ranks'
        r = self.world // self.nodes
        return f'`shuffle_scope="node"`, {self.nodes} nodes × {r} rank{"s" if r > 1 else ""}'


#: The first experiment: one world of 8 ranks, only the nodes changing.
DEFAULT_CONFIGS = ("node2x4", "node4x2", "node8x1", "global-w8", "full-w8")


def renamed(name: str, world: int) -> str:
    """A run's configuration under this module's names: the first JSON of this suite named them ``node{N}``,
    ``global`` and ``full``, all in one world of ``world`` ranks."""
    if name in ("global", "full"):
        return f"{name}-w{world}"
    if name.startswith("node") and "x" not in name:
        return f"{name}x{world // int(name[4:])}"
    return name


@contextlib.contextmanager
def torchrun_env(world: int, nodes: int, rank: int) -> Iterator[None]:
    """The variables torchrun sets for ``rank`` of ``world`` ranks on ``nodes`` nodes (ranks numbered node by
    node), restored afterwards: the loader's node count is read from them, so they are what is simulated."""
    local = world // nodes
    saved = {k: os.environ.get(k) for k in TORCHRUN_VARIABLES}
    os.environ.update(
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(local), GROUP_RANK=str(rank // local),
        NODE_RANK=str(rank // local), RANK=str(rank), LOCAL_RANK=str(rank % local),
    )  # fmt: skip
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def rank_samplers(c: Config, seed: int, s: Settings) -> list[EpochSampler]:
    """Every rank's sampler as ``AsyncLoader`` builds it (``LoaderOptions.sampler``) in a torchrun world of
    ``c.world`` ranks on ``c.nodes`` nodes; refuses a world whose node count the library does not read as asked."""
    world = c.world
    if world % c.nodes or s.batch % world:
        raise SystemExit(f"world {world} must split into {c.nodes} equal nodes and divide batch {s.batch}")
    opts = LoaderOptions(
        batch_size=s.batch // world, shuffle=True, seed=seed, shuffle_block=c.block, shuffle_window=c.window,
        shuffle_scope=c.scope,  # type: ignore[arg-type]
    )  # fmt: skip
    out = []
    for r in range(world):
        with torchrun_env(world, c.nodes, r):
            sampler = opts.sampler(s.train_rows, Shard(rank=r, world_size=world))
        want = c.nodes if c.scope == "node" else 1
        if sampler.nodes != want:
            raise SystemExit(f"{c.name}: the loader read {sampler.nodes} nodes, not {want}")
        out.append(sampler)
    return out


def global_batches(samplers: list[EpochSampler], epoch: int) -> list[np.ndarray]:
    """Step ``k``'s global batch: every rank's batch ``k``, rank by rank (what DDP's averaged gradient sees)."""
    per_rank = [sm.batches(epoch) for sm in samplers]
    steps = {len(b) for b in per_rank}
    if len(steps) != 1:
        raise AssertionError(f"ranks have unequal batch counts {steps}")
    return [np.concatenate([b[k] for b in per_rank]).astype(np.int64) for k in range(steps.pop())]


@dataclass
class Rows:
    """The dataset in memory, in storage order: uint8 NHWC images and uint8 masks, as the loader yields them."""

    images: torch.Tensor
    masks: torch.Tensor


def load_rows(source: DeepLakeSource) -> Rows:
    """Every row read once with ``AsyncLoader`` in storage order (the batches' ``index`` checked), so that a
    global batch is an index into tensors and the runs spend their time training, not reading."""
    images, masks = [], []
    seen = 0
    with AsyncLoader(source, 64, shuffle=False) as loader:
        for batch in loader:
            if batch["index"].tolist() != list(range(seen, seen + len(batch["index"]))):
                raise AssertionError("storage-order batches out of order")
            seen += len(batch["index"])
            images.append(batch["images"])
            masks.append(batch["masks"])
    return Rows(torch.cat(images), torch.cat(masks))


@torch.no_grad()
def evaluate(net: UNet, data: Rows, s: Settings) -> list[float]:
    """Per-class IoU over the held-out rows (those after the training rows), each counted once."""
    net.eval()
    k = len(CLASS_NAMES)
    counts = torch.zeros(2 * k, dtype=torch.float64)
    for a in range(s.train_rows, s.train_rows + s.val_rows, 64):
        b = min(a + 64, s.train_rows + s.val_rows)
        images = StepOptions(torch.device("cpu")).inputs(data.images[a:b])
        counts += iou_counts(net(images), data.masks[a:b], b - a, k)
    net.train()
    return [float(counts[c] / counts[k + c]) if counts[k + c] else math.nan for c in range(k)]


def train_run(c: Config, seed: int, data: Rows, rows: tuple[np.ndarray, np.ndarray], s: Settings) -> Run:
    """Train a fresh U-Net (initialised from ``seed``) for ``s.epochs`` epochs of the world's global batches."""
    t0 = time.perf_counter()
    how = StepOptions(torch.device("cpu"))
    torch.manual_seed(seed)
    net = UNet(len(CLASS_NAMES), s.width)
    opt = torch.optim.Adam(net.parameters(), lr=s.lr)
    samplers = rank_samplers(c, seed, s)
    run = Run(c.name, seed, math.nan, {})
    distinct: list[tuple[int, int]] = []
    ious: list[float] = []
    for epoch in range(s.epochs):
        t = time.perf_counter()
        batches = global_batches(samplers, epoch)
        if sorted(np.concatenate(batches).tolist()) != list(range(s.train_rows)):
            raise AssertionError(f"{c.name} epoch {epoch}: the world did not read every training row once")
        losses = []
        for index in batches:
            distinct.append((len(np.unique(rows[0][index])), len(np.unique(rows[1][index]))))
            i = torch.from_numpy(index)
            losses.append(train_step(net, opt, data.images[i], data.masks[i], how))
        run.steps += len(batches)
        run.train_s += time.perf_counter() - t
        run.loss.append(float(torch.stack(losses).mean()))
        ious = evaluate(net, data, s)
        run.curve.append(float(np.nanmean(ious)))
        print(
            f"  {c.name:9s} seed {seed} epoch {epoch + 1}/{s.epochs}: loss {run.loss[-1]:.3f}  held-out mIoU "
            f"{100 * run.curve[-1]:.1f}  ({time.perf_counter() - t0:.0f} s so far)",
            flush=True,
        )
    run.miou, run.iou = run.curve[-1], dict(zip(CLASS_NAMES, ious, strict=True))
    run.clips_per_batch, run.photos_per_batch = (float(v) for v in np.mean(distinct, axis=0))
    run.wall_s = time.perf_counter() - t0
    return run


def rank_reach(c: Config, seed: int, s: Settings) -> float:
    """The share of the training rows that rank 0 reads over the run's epochs: its node's part (about
    ``1 / nodes``) for the node-stable order, nearer all of them for a global order. It shows that the
    partition is in force; it is not a quality figure."""
    sm = rank_samplers(c, seed, s)[0]
    return len(set(np.concatenate([sm.rank_indices(e) for e in range(s.epochs)]).tolist())) / s.train_rows


# -- the report ----------------------------------------------------------------------------------


def paired(rs: list[Run], base: list[Run]) -> list[float]:
    """Points by which each of ``rs`` differs from the run of ``base`` with its seed (same weights' start)."""
    by_seed = {r.seed: r.miou for r in base}
    return [100 * (r.miou - by_seed[r.seed]) for r in rs if r.seed in by_seed]


def verdict(c: Config, rs: list[Run], base: list[Run]) -> dict[str, Any]:
    """Where an order's mean lies against the global shuffle's seeds in the same world: within their range,
    or above or below it and by how much (points), with the paired per-seed differences beside it, because a
    range of 3 seeds can be narrower than the differences the seeds make to every order."""
    m, g = summary(rs), summary(base)
    d = paired(rs, base)
    above, below = m["mean"] - g["max"], g["min"] - m["mean"]
    return {
        "config": c.name, "nodes": c.nodes, "ranks_per_node": c.world // c.nodes, "world": c.world,
        "order": c.label, "mean": m, "global": g, "difference_points": m["mean"] - g["mean"], "paired_points": d,
        "within_range": g["min"] <= m["mean"] <= g["max"],
        "position": "within" if g["min"] <= m["mean"] <= g["max"] else
        (f"above by {above:.2f}" if above > 0 else f"below by {below:.2f}"),
    }  # fmt: skip


def report(runs: list[Run], s: Settings, cs: list[Config], url: str, extra: dict[str, Any], out: Path) -> str:
    """The verdict, the tables per world and the curves in markdown, and the JSON beside them."""
    by = {c.name: [r for r in runs if r.order == c.name] for c in cs}
    cs = [c for c in cs if by[c.name]]
    seeds = sorted({r.seed for r in runs})
    worlds = sorted({c.world for c in cs})
    base = {c.world: by[c.name] for c in cs if c.scope == "global" and c.block > 1}
    judged = [c for c in cs if c.scope == "node" and len(base.get(c.world, [])) > 1]
    verdicts = [verdict(c, by[c.name], base[c.world]) for c in sorted(judged, key=lambda c: (c.nodes, c.world))]
    # the full shuffle judged the same way: how much a range of 3 seeds can tell
    calibration = [verdict(c, by[c.name], base[c.world]) for c in cs if c.block == 1 and len(base.get(c.world, [])) > 1]
    steps = s.train_rows // s.batch
    lines = [
        "# Training quality: the node-stable order against a global shuffle",
        "",
        f"The compact U-Net (`asyncload.tools.train.UNet`, width {s.width}) trained on {s.train_rows} clip-ordered rows "
        f"of {s.size}×{s.size} px for {s.epochs} epochs of {steps} steps, each step a global batch of {s.batch} rows made "
        f"of every simulated rank's batch (as DDP averages them), Adam lr {s.lr:g}; held-out mIoU over {s.val_rows} rows "
        f"after the last epoch. Node and global orders: block {s.block} / window {s.window} (`shuffle_training`'s scaled "
        "default). `benchmarks/suites/partition_training.py`; what exactly was run, the machine and the load are below.",
        "",
        "## Verdict",
        "",
        'Is the node-stable order\'s mean held-out mIoU within the range of the 3 seeds of `shuffle_scope="global"` '
        "in the same world?",
        "",
        "| order | mIoU, mean ± std | global, same world: mean ± std (range) | difference of the means (paired, "
        "per seed) | within the global range? |",
        "|---|---|---|---|---|",
    ]
    for v in verdicts + calibration:
        m, g, d = v["mean"], v["global"], v["paired_points"]
        name = v["order"] + (" (calibration: the same test)" if v in calibration else "")
        lines.append(
            f"| {name} | {m['mean']:.2f} ± {m['std']:.2f} | {g['mean']:.2f} ± {g['std']:.2f} ({g['min']:.2f}–"
            f"{g['max']:.2f}) | {v['difference_points']:+.2f} ({', '.join(f'{x:+.1f}' for x in d)}) | "
            f"**{'yes' if v['within_range'] else 'no'}**{'' if v['within_range'] else ', ' + v['position']} |"
        )
    if extra.get("reading"):
        lines += ["", f"Reading: {extra['reading']}"]
    for w in worlds:
        ws = [c for c in cs if c.world == w]
        lines += [
            "",
            f"## A world of {w} ranks ({s.batch // w} rows each)",
            "",
            "| configuration | " + " | ".join(f"seed {x}" for x in seeds) + " | mean ± std | range | "
            "− global (paired mean) | distinct clips / photos per global batch | rows rank 0 reads over the run |",
            "|---|" + "---|" * (len(seeds) + 5),
        ]  # fmt: skip
        for c in ws:
            rs, m = by[c.name], summary(by[c.name])
            per = {r.seed: 100 * r.miou for r in rs}
            is_base = c.scope == "global" and c.block > 1
            d = [] if is_base else paired(rs, base.get(w, []))
            lines.append(
                f"| {c.label} | " + " | ".join(f"{per[x]:.1f}" if x in per else "–" for x in seeds)
                + f" | **{m['mean']:.1f} ± {m['std']:.1f}** | {m['min']:.1f}–{m['max']:.1f} | "
                + (f"{statistics.fmean(d):+.1f}" if d else "")
                + f" | {statistics.fmean(r.clips_per_batch for r in rs):.1f} / {statistics.fmean(r.photos_per_batch for r in rs):.1f}"
                + f" | {extra['reach'].get(c.name, math.nan):.0%} |"
            )  # fmt: skip
    for title, key, scale, fmt in (("Held-out mIoU", "curve", 100, ".1f"), ("Training loss", "loss", 1, ".3f")):
        lines += ["", f"## {title} after each epoch (mean ± std over seeds)", "",
                  "| configuration | " + " | ".join(f"epoch {e + 1}" for e in range(s.epochs)) + " |",
                  "|---|" + "---|" * s.epochs]  # fmt: skip
        for c in cs:
            cells = []
            for e in range(s.epochs):
                v = [scale * getattr(r, key)[e] for r in by[c.name]]
                cells.append(f"{statistics.fmean(v):{fmt}} ± {statistics.stdev(v) if len(v) > 1 else 0.0:{fmt}}")
            n = len(by[c.name])
            lines.append(f"| {c.label} ({n} seed{'s' if n > 1 else ''}) | " + " | ".join(cells) + " |")
    lines += ["", "## Per-class held-out IoU (mean over seeds)", "",
              "| configuration | " + " | ".join(CLASS_NAMES) + " |", "|---|" + "---|" * len(CLASS_NAMES)]  # fmt: skip
    for c in cs:
        cells = [f"{statistics.fmean(100 * r.iou[k] for r in by[c.name]):.1f}" for k in CLASS_NAMES]
        lines.append(f"| {c.label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## What was run",
        "",
        f"- Data: `{url}` ({s.train_rows + s.val_rows} rows, `shuffle_training.make_data`, seed {DATA_SEED}): training "
        f"rows [0, {s.train_rows}) are {s.train_rows // s.clip} clips of {s.clip} consecutive panning frames, sorted by "
        f"source photograph ({', '.join(PHOTOS)}), so neighbouring rows are near-duplicates; held-out rows "
        f"[{s.train_rows}, {s.train_rows + s.val_rows}) are independent `photo_sample` crops of the same photos. Read "
        "once into memory with `AsyncLoader` in storage order; each global batch indexes those tensors.",
        "- Each simulated rank's sampler is the loader's own: `LoaderOptions(batch_size=32/W, shuffle=True, seed=seed, "
        f"shuffle_block=B, shuffle_window={s.window}, shuffle_scope=S).sampler({s.train_rows}, Shard(rank=r, "
        "world_size=W))`, built under the torchrun variables of rank r (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`, "
        "`GROUP_RANK`/`NODE_RANK`, `RANK`, `LOCAL_RANK`; ranks numbered node by node), with the loader's node count "
        f"checked against the one asked for. B = {s.block} for the node and global orders, 1 for the full shuffle. Step k "
        "trains on ranks 0..W−1's batch k concatenated. Every epoch was checked to read each training row exactly once.",
        f"- Same in every run: model, initialisation (`torch.manual_seed(seed)`), Adam lr {s.lr:g}, {s.epochs} epochs, "
        f"{steps} steps per epoch, global batch {s.batch}, no augmentation; seeds {', '.join(map(str, seeds))} (weights and "
        "loader's seed, which also chooses the node parts). Within a seed the configurations' runs alternate.",
        '- "Rows rank 0 reads over the run": the share of the training rows in rank 0\'s batches over all epochs '
        "(seed 0); the node-stable order keeps it to its node's part, which shows the partition is in force.",
        f"- Runs: {extra['command']}.",
        *(f"- {n}" for n in extra.get("notes", [])),
        "",
        "## What the figures can and cannot show",
        "",
        f"A {s.size}-px U-Net of width {s.width} trained for {s.epochs} epochs of {s.train_rows} rows on a CPU: far from "
        "converged (the curves still rise), on one synthetic dataset built so that order matters (clips of near-identical "
        "frames stored together). 3 seeds give a rough spread, not a test of small differences: differences under about "
        "a point are not resolved. The simulated world's order is exactly the loader's, but nothing of a real cluster's "
        "timing is (DDP's steps are synchronous). One thing differs from plain DDP: the U-Net's BatchNorm layers see the "
        "whole global batch here, as `SyncBatchNorm` would, while under plain DDP each rank normalises over its own rows "
        "and the running statistics used at evaluation are rank 0's (DDP broadcasts its buffers); with the node-stable "
        "order rank 0's rows are its node's part only (the last column of the tables), so a model with BatchNorm under "
        "plain DDP may fare differently; that is not measured here. A global batch made of W ranks' batches draws "
        "from W places of the epoch's order, so a world of several ranks mixes batches more than one process reading the "
        "same block order (`benchmarks/results/large/training_quality.md`, one process, batch 32: block 16 / window 256 "
        "cost 6.3 points against a full shuffle); worlds where each rank reads much more of the global batch, longer "
        "training, larger models and real datasets are not measured here.",
        "",
        "## Time per run",
        "",
        "| configuration | seed | training s | run s (incl. evaluation each epoch) |",
        "|---|---|---|---|",
        *[
            f"| {next(c.label for c in cs if c.name == r.order)} | {r.seed} | {r.train_s:.0f} | {r.wall_s:.0f} |"
            for r in runs
        ],
        "",
        f"Machine: {extra['machine']}; {extra['date']}; load: {extra['load']}. "
        f"{platform.python_implementation()} {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, CPU only.",
    ]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "training_quality.md").write_text(text)
    doc = {
        "settings": asdict(s), "configs": [asdict(c) for c in cs], "dataset": url, "verdicts": verdicts,
        "calibration": calibration,
        "summary": {c.name: summary(by[c.name]) for c in cs}, "runs": [asdict(r) for r in runs], **extra,
    }  # fmt: skip
    (out / "training_quality.json").write_text(json.dumps(doc, indent=1))
    return text


def machine() -> str:
    """Cores, CPU model and OS, for the report."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores ({model}), {platform.system()} {platform.release()}"


def earlier(path: str, s: Settings) -> tuple[list[Run], list[Config], dict[str, Any]]:
    """The runs, configurations and circumstances of a report's JSON, under this module's names (``renamed``)."""
    doc = json.loads(Path(path).read_text())
    theirs = {**doc["settings"], "seeds": None, "variant": None}
    if theirs != {**asdict(s), "seeds": None, "variant": None}:  # seeds may differ between the parts, nothing else
        raise SystemExit(f"{path}: its runs had other settings than these ({doc['settings']})")
    world = int(doc.get("world", 0))  # the first JSON: one world for all
    runs = [Run(**{**r, "order": renamed(r["order"], world)}) for r in doc["runs"]]
    cs = [Config.parse(renamed(c["name"], world), s) for c in doc["configs"]]
    reach = {renamed(k, world): v for k, v in doc["reach"].items()}
    loads = doc.get("loads", [])
    # what an earlier part said of its load, where its loads are not in the list (the first JSON kept none)
    before = doc.get("load_before", "" if loads else f"{doc['load']}; then ")
    command = doc["command"].strip()
    if not command.startswith("`"):  # (the first JSON's command was bare)
        command = f"`{command}`"
    return runs, cs, {
        "reach": reach, "loads": loads, "date": doc["date"], "command": command, "load": doc["load"],
        "load_before": before, "notes": doc.get("notes", []), "reading": doc.get("reading", ""),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    ap.add_argument("--epochs", type=int, default=d.epochs)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(d.seeds))
    ap.add_argument(
        "--configs",
        nargs="+",
        default=list(DEFAULT_CONFIGS),
        help="node<N>x<R>, global-w<W>, full-w<W>, run in this order",
    )
    ap.add_argument("--merge", help="a training_quality.json of the same settings whose runs join this report")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/partition"))
    ap.add_argument("--from-json", help="rewrite the report from a training_quality.json, training nothing")
    ap.add_argument("--note", help="a sentence for the report's 'What was run' (kept with merges)")
    ap.add_argument("--reading", help="what the verdict table says, in words, under it (with --from-json)")
    a = ap.parse_args(argv)
    s = Settings(epochs=a.epochs, seeds=tuple(a.seeds))
    path = ROOT / f"data/bench/photo-clips-{s.size}px-{s.train_rows // s.clip}x{s.clip}+{s.val_rows}-jpg"
    url = f"file://{path}"
    if a.from_json:
        runs, cs, extra = earlier(a.from_json, s)
        extra["notes"] = [*extra["notes"], *([a.note] if a.note else [])]
        extra["reading"] = a.reading or extra.get("reading", "")
        print(report(runs, s, cs, url, {**extra, "machine": machine()}, Path(a.out)))
        return 0
    todo = [Config.parse(n, s) for n in a.configs]
    command = (
        "`nice -n 19 .venv/bin/python benchmarks/suites/partition_training.py "
        + " ".join(sys.argv[1:] if argv is None else argv)
        + "`"
    )
    runs: list[Run] = []
    cs: list[Config] = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    old: dict[str, Any] = {"reach": {}, "loads": []}
    if a.merge:
        runs, cs, old = earlier(a.merge, s)
        started = old["date"].split(" to ")[0]
        command = f"{old['command']}, then {command}"
    cs += [c for c in todo if c.name not in [x.name for x in cs]]
    rows = make_data(url, s)
    data = load_rows(DeepLakeSource(url, ("images", "masks")))
    reach = {**old["reach"], **{c.name: rank_reach(c, s.seeds[0], s) for c in todo}}
    loads: list[float] = list(old["loads"])
    before = old.get("load_before", "")
    notes = [*old.get("notes", []), *([a.note] if a.note else [])]
    done = {(r.order, r.seed) for r in runs}  # a merged report's runs are not run again (a resumed experiment)
    plan = [(c, seed) for seed in s.seeds for c in todo if (c.name, seed) not in done]
    text = ""
    for k, (c, seed) in enumerate(plan):
        print(f"run {k + 1}/{len(plan)}: {c.name} seed {seed}", flush=True)
        runs.append(train_run(c, seed, data, rows, s))
        loads.append(os.getloadavg()[0])
        r = runs[-1]
        print(
            f"run {k + 1}/{len(plan)} done: {c.name} seed {seed} mIoU {100 * r.miou:.1f} in {r.wall_s:.0f} s",
            flush=True,
        )
        extra = {
            "reach": reach, "loads": loads, "machine": machine(), "command": command, "notes": notes,
            "load_before": before,
            "date": f"{started} to {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "load": f"{before}1-minute load average at the end of each run {min(loads):.1f}–{max(loads):.1f} on "
            f"{os.cpu_count()} cores (other engineers' tests sharing them; these runs at nice 19)",
        }  # fmt: skip
        text = report(
            runs, s, cs, url, extra, Path(a.out)
        )  # after every run: a cut-short experiment keeps what finished
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
