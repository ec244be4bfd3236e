"""What does reading a shuffled epoch in blocks cost a model? The U-Net trained with a full shuffle and with
the block order, same steps and seeds, mIoU side by side.

    nice -n 5 .venv/bin/python benchmarks/suites/shuffle_training.py [--epochs 4] [--seeds 0 1 2] [--control] [--out benchmarks/results/large]

Why this dataset. A block order (``sampler.block_order``) keeps ``block`` contiguous rows together and
mixes ``window / block`` blocks into each batch. On rows written in a random order that changes nothing a
model can see, by construction: any contiguous rows are as varied as random ones. It can only hurt where
neighbouring rows are alike, as real datasets are written (frames of one video, tiles of one slide). So
the training rows here are **written in collection order**: video-like **clips of 48 consecutive frames**,
each a view of one of the 7 scikit-image photographs of ``benchmarks/testbeds/photos.py`` panning in a
straight line by up to half its side (one crop scale, mirroring and exposure per clip, drawn as
``photo_sample`` draws them per row; fresh sensor noise per frame), **the clips sorted by their source
photograph**. Neighbouring rows are near-duplicates, so a block of 16 rows is 16 frames of one shot.
Masks: ``photo_sample``'s, the 4 quartiles of the image's blurred luminance, which the compact U-Net
learns in a few minutes. The held-out rows are independent ``photo_sample`` crops of the same photos,
stored after the training rows and read in order (order does not change an evaluation).
(A first try, independent ``photo_sample`` crops merely sorted by photo, was a weak test: blocks come
in a random order, so a block-order batch still drew from 6.2 of the 7 photos, against 7.0.)

Scaling. The Deep Lake default was ``shuffle_block=64``, ``shuffle_window=1024`` (now 4096) on datasets of 100,000s
of rows. On ~1,500 training rows that window would be most of the dataset, and the order nearly a full
shuffle. So the block order is scaled to keep its shape: block 16, window 256 (the same 16 blocks mixed
per batch; the dataset 6 windows long). Everything else is the same for both orders: rows, image size,
model (``asyncload.tools.train.UNet``, width 16), optimizer (Adam, lr 3e-3), batch 32, epochs, the steps
(``asyncload.tools.train.train_step``, timed by ``timed_steps``, as ``asyncload train`` runs them), and per seed
the weights' initialisation and the loader's seed (seeds 0, 1, 2). Runs of the two orders alternate, so
both see the same load on a shared machine. ``--control`` adds one run read in storage order
(``shuffle=False``), the worst case, to show how order-sensitive the dataset is at all.

A second block order can be tried and joined to a finished report, e.g. smaller blocks in the same window:
``--orders variant --variant 4 256 --merge benchmarks/results/large/training_quality.json``;
``--from-json`` rewrites the report from its JSON without training.

Sizes (48 px, 1,536 + 384 rows, 4 epochs) are what 2 shared cores train in ~3-4 minutes a run; the
per-epoch held-out curve in the report shows how far from converged that is.

Writes ``training_quality.md`` and ``.json`` under ``--out``; the dataset is made once under
``data/bench/`` and kept.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asyncload import AsyncLoader  # noqa: E402
from asyncload.sources.deeplake import DeepLakeSource  # noqa: E402
from asyncload.tools.train import RangeSource, StepOptions, UNet, timed_steps, train_step  # noqa: E402
from asyncload.tools.train.steps import iou_counts  # noqa: E402
from benchmarks.testbeds.photos import PHOTOS, _sources, encode, photo_sample  # noqa: E402

CLASS_NAMES = ("darkest quarter", "dark quarter", "light quarter", "lightest quarter")
DATA_SEED = 7  # the rows' seed; the training seeds are separate
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Settings:
    """One experiment: the data, the two orders and the training, the same for every run."""

    train_rows: int = 1536
    val_rows: int = 384
    size: int = 48
    clip: int = 48  # frames per clip (one shot panning across one photo)
    batch: int = 32
    epochs: int = 4
    lr: float = 3e-3
    width: int = 16
    block: int = 16
    window: int = 256
    seeds: tuple[int, ...] = SEEDS
    variant: tuple[int, int] | None = None  # a second block order (block, window) to try, if any


@dataclass
class Run:
    """One training run's outcome."""

    order: str
    seed: int
    miou: float
    iou: dict[str, float]
    curve: list[float] = field(default_factory=list)  # held-out mIoU after each epoch
    loss: list[float] = field(default_factory=list)  # mean training loss of each epoch
    clips_per_batch: float = 0.0  # distinct clips per training batch, mean
    photos_per_batch: float = 0.0  # distinct source photographs per training batch, mean
    steps: int = 0
    train_s: float = 0.0
    wall_s: float = 0.0


# -- the dataset ---------------------------------------------------------------------------------


def luminance_classes(img: np.ndarray) -> np.ndarray:
    """``photo_sample``'s mask: the quartile (0-3) of each pixel's box-blurred luminance in its image."""
    from PIL import Image, ImageFilter

    levels = np.asarray(Image.fromarray(img).convert("L").filter(ImageFilter.BoxBlur(4)))
    return np.digitize(levels, np.percentile(levels, [25, 50, 75])).astype(np.uint8)


def clip(rng: np.random.Generator, photo: int, frames: int, size: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``frames`` consecutive (image, mask) frames of one shot: a ``size``-pixel view of ``photo`` panning
    in a straight line by up to half its side, with one crop scale, mirroring and exposure for the
    whole shot (drawn as ``photo_sample`` draws them per row) and fresh sensor noise in every frame."""
    from PIL import Image

    src = _sources()[photo]
    h, w = src.shape[:2]
    side = int(rng.integers(min(size, h, w), min(h, w) + 1))
    y0, x0 = int(rng.integers(0, h - side + 1)), int(rng.integers(0, w - side + 1))
    dy, dx = (int(rng.integers(-side // 2, side // 2 + 1)) for _ in range(2))
    y1, x1 = min(max(y0 + dy, 0), h - side), min(max(x0 + dx, 0), w - side)
    flip, gain, offset = rng.random() < 0.5, rng.uniform(0.85, 1.15), rng.uniform(-12, 12)
    noise_std = rng.uniform(1.5, 3.5)
    out = []
    for f in range(frames):
        t = f / max(frames - 1, 1)
        y, x = round(y0 + t * (y1 - y0)), round(x0 + t * (x1 - x0))
        arr = np.asarray(
            Image.fromarray(src[y : y + side, x : x + side]).resize((size, size), Image.BILINEAR), np.float32
        )
        if flip:
            arr = arr[:, ::-1]
        arr = np.clip(arr * gain + offset + rng.normal(0, noise_std, arr.shape), 0, 255).astype(np.uint8)
        out.append((np.ascontiguousarray(arr), luminance_classes(arr)))
    return out


def layout(s: Settings) -> tuple[list[int], list[int]]:
    """The training split's clips in stored order and their photos: clip ``c``'s photo is the first draw
    of its generator; the clips are stored sorted by photo (then by clip number)."""
    clips = s.train_rows // s.clip
    photo = [int(np.random.default_rng([DATA_SEED, c]).integers(len(PHOTOS))) for c in range(clips)]
    order = sorted(range(clips), key=lambda c: (photo[c], c))
    return order, [photo[c] for c in order]


def make_data(url: str, s: Settings) -> tuple[np.ndarray, np.ndarray]:
    """Write the dataset at ``url`` unless it is there; returns the clip and the photo of every training row.

    Rows ``[0, train_rows)``: ``train_rows / clip`` clips of ``clip`` frames, sorted by photo (collection
    order); rows ``[train_rows, train_rows + val_rows)``: independent ``photo_sample`` crops (held out)."""
    import deeplake

    if s.train_rows % s.clip:
        raise SystemExit(f"--train-rows {s.train_rows} is not a whole number of clips of {s.clip} frames")
    order, photo = layout(s)
    clip_of_row = np.repeat(np.arange(len(order)), s.clip)
    photo_of_row = np.repeat(np.array(photo), s.clip)
    if deeplake.exists(url):
        return clip_of_row, photo_of_row
    t0 = time.perf_counter()
    n = s.train_rows + s.val_rows
    print(f"making {n} rows ({s.size}x{s.size} JPEG q90 + lz4 masks) at {url}", flush=True)
    ds = deeplake.create(url)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="lz4"))
    ds["masks"].metadata["class_names"] = list(CLASS_NAMES)
    ds.metadata["generator"] = (
        f"benchmarks/suites/shuffle_training.py seed={DATA_SEED} size={s.size}: rows [0, {s.train_rows}) "
        f"{len(order)} clips of {s.clip} panning frames sorted by photo ({','.join(PHOTOS)}); rows "
        f"[{s.train_rows}, {n}) photo_sample crops, held out"
    )

    def append(pairs: list[tuple[np.ndarray, np.ndarray]], ds: Any = ds) -> None:
        ds.append({"images": [encode(p[0], "jpg") for p in pairs], "masks": np.stack([p[1] for p in pairs])})

    for c, p in zip(order, photo, strict=True):
        rng = np.random.default_rng([DATA_SEED, c])
        rng.integers(len(PHOTOS))  # the photo, drawn by ``layout``
        append(clip(rng, p, s.clip, s.size))
    held_out = range(10**6, 10**6 + s.val_rows)  # generators apart from the clips'
    for start in range(0, s.val_rows, 64):
        append([photo_sample(np.random.default_rng([DATA_SEED, i]), s.size) for i in held_out[start : start + 64]])
    ds.commit(f"{n} photo frames, training clips in collection order")
    del ds
    print(f"made in {time.perf_counter() - t0:.0f} s", flush=True)
    return clip_of_row, photo_of_row


# -- training and evaluation ---------------------------------------------------------------------


@torch.no_grad()
def evaluate(net: UNet, source: DeepLakeSource, s: Settings) -> list[float]:
    """Per-class IoU over the held-out rows, read in order, each counted once."""
    net.eval()
    k = len(CLASS_NAMES)
    counts = torch.zeros(2 * k, dtype=torch.float64)
    with AsyncLoader(RangeSource(source, s.train_rows, s.train_rows + s.val_rows), 64, shuffle=False) as loader:
        for batch in loader:
            counts += iou_counts(net(batch["images"]), batch["masks"], len(batch["images"]), k)
    net.train()
    return [float(counts[c] / counts[k + c]) if counts[k + c] else math.nan for c in range(k)]


def train_run(order: str, seed: int, source: DeepLakeSource, rows: tuple[np.ndarray, np.ndarray], s: Settings) -> Run:
    """Train a fresh U-Net (initialised from ``seed``) for ``s.epochs`` epochs of the training rows in
    ``order`` ("full": ``shuffle_block=1``; "block": ``s.block`` / ``s.window``; "variant": ``s.variant``;
    "storage": no shuffle)."""
    t0 = time.perf_counter()
    how = StepOptions(torch.device("cpu"))
    torch.manual_seed(seed)
    net = UNet(len(CLASS_NAMES), s.width)
    opt = torch.optim.Adam(net.parameters(), lr=s.lr)
    reading: dict[str, Any] = {
        "full": dict(shuffle=True, shuffle_block=1),
        "block": dict(shuffle=True, shuffle_block=s.block, shuffle_window=s.window),
        "storage": dict(shuffle=False),
        "variant": dict(shuffle=True, shuffle_block=s.variant[0], shuffle_window=s.variant[1]) if s.variant else {},
    }[order]
    run = Run(order, seed, math.nan, {})
    distinct: list[tuple[int, int]] = []  # clips and photos of each batch
    train = RangeSource(source, 0, s.train_rows)
    with AsyncLoader(train, s.batch, seed=seed, **reading) as loader:
        for epoch in range(s.epochs):
            loader.set_epoch(epoch)
            losses: list[torch.Tensor] = []

            def step(batch: dict[str, torch.Tensor], losses: list[torch.Tensor] = losses) -> torch.Tensor:
                index = batch["index"].numpy()
                distinct.append((len(np.unique(rows[0][index])), len(np.unique(rows[1][index]))))
                loss = train_step(net, opt, batch["images"], batch["masks"], how)
                losses.append(loss)
                return loss

            times = timed_steps(iter(loader), step, how.device)
            run.steps += times.steps
            run.train_s += times.wall_s
            run.loss.append(float(torch.stack(losses).mean()))
            ious = evaluate(net, source, s)
            run.curve.append(float(np.nanmean(ious)))
            print(
                f"  {order:7s} seed {seed} epoch {epoch + 1:2d}/{s.epochs}: loss {run.loss[-1]:.3f}  "
                f"held-out mIoU {100 * run.curve[-1]:.1f}  ({times.wall_s:.0f} s train, "
                f"{time.perf_counter() - t0:.0f} s so far)",
                flush=True,
            )
    run.miou, run.iou = run.curve[-1], dict(zip(CLASS_NAMES, ious, strict=True))
    run.clips_per_batch, run.photos_per_batch = (float(v) for v in np.mean(distinct, axis=0))
    run.wall_s = time.perf_counter() - t0
    return run


# -- the report ----------------------------------------------------------------------------------


def summary(runs: list[Run]) -> dict[str, float]:
    """mIoU in points: mean, sample standard deviation, min and max over the seeds."""
    m = [100 * r.miou for r in runs]
    if not m:
        return {"mean": math.nan, "std": math.nan, "min": math.nan, "max": math.nan, "seeds": 0}
    return {
        "mean": statistics.fmean(m), "std": statistics.stdev(m) if len(m) > 1 else 0.0,
        "min": min(m), "max": max(m), "seeds": len(m),
    }  # fmt: skip


def report(runs: list[Run], s: Settings, url: str, photos: np.ndarray, made_s: float, out: Path) -> str:
    """The markdown table and the JSON beside it."""
    by = {o: [r for r in runs if r.order == o] for o in ("full", "block", "variant", "storage")}
    full, block = summary(by["full"]), summary(by["block"])
    paired = [100 * (b.miou - f.miou) for f, b in zip(by["full"], by["block"], strict=False)]
    diff = block["mean"] - full["mean"]
    runs_per_photo = [int(c) for c in np.bincount(photos[: s.train_rows], minlength=len(PHOTOS))]
    block_name = f"block order, block {s.block} / window {s.window}"
    lines = [
        "# Training quality: full shuffle against the block order",
        "",
        f"The compact U-Net (`asyncload.tools.train.UNet`, width {s.width}) trained on the same rows for the same "
        f"{by['full'][0].steps if by['full'] else 0} steps ({s.epochs} epochs of {s.train_rows} rows, batch {s.batch}, "
        f"Adam lr {s.lr:g}), read by `AsyncLoader(DeepLakeSource(url), shuffle=True, seed=s)` with "
        f"`shuffle_block=1` (full shuffle) and with `shuffle_block={s.block}, shuffle_window={s.window}`; "
        f"held-out mIoU over {s.val_rows} rows after the last epoch "
        "(`benchmarks/suites/shuffle_training.py`).",
        "",
        "| seed | full shuffle mIoU | " + block_name + " mIoU | difference (block − full) |",
        "|---|---|---|---|",
    ]
    for f, b in zip(by["full"], by["block"], strict=False):
        lines.append(f"| {f.seed} | {100 * f.miou:.1f} | {100 * b.miou:.1f} | {100 * (b.miou - f.miou):+.1f} |")
    lines += [
        f"| **mean ± std** | **{full['mean']:.1f} ± {full['std']:.1f}** | **{block['mean']:.1f} ± {block['std']:.1f}** "
        f"| **{diff:+.1f}** (paired: {statistics.fmean(paired) if paired else math.nan:+.1f} ± "
        f"{statistics.stdev(paired) if len(paired) > 1 else 0.0:.1f}) |",
        f"| range | {full['min']:.1f}–{full['max']:.1f} | {block['min']:.1f}–{block['max']:.1f} | |",
        "",
        f"Target: the block order's mean within 1 point of the full shuffle's: **{'met' if abs(diff) <= 1 else 'not met'}** "
        f"({diff:+.1f} points over {block['seeds']} seeds).",
        "",
    ]
    if by["variant"] and s.variant:
        vb, vw = s.variant
        v = summary(by["variant"])
        per_seed = {f.seed: f.miou for f in by["full"]}
        vd = [100 * (r.miou - per_seed[r.seed]) for r in by["variant"] if r.seed in per_seed]
        lines += [
            f"A second block order, **block {vb} / window {vw}** ({vw // vb} blocks mixed per batch, window "
            f"{vw / s.window:g}× and blocks {vb / s.block:g}× the first's; at the default's scale block "
            f"{vb * 64 // s.block} / window {vw * 64 // s.block}; run after the others, joined with `--merge`): mIoU {', '.join(f'{100 * r.miou:.1f}' for r in by['variant'])} "
            f"(seeds {', '.join(str(r.seed) for r in by['variant'])}), **{v['mean']:.1f} ± {v['std']:.1f}**, "
            f"**{v['mean'] - full['mean']:+.1f}** against the full shuffle "
            f"(paired: {statistics.fmean(vd) if vd else math.nan:+.1f}).",
            "",
        ]
    lines += [
        "Per-class IoU (mean over seeds):",
        "",
        "| order | " + " | ".join(CLASS_NAMES) + " | distinct clips per batch | distinct photos per batch "
        "| training loss, last epoch |",
        "|---|" + "---|" * (len(CLASS_NAMES) + 3),
    ]
    names = {"full": "full shuffle", "block": block_name, "storage": "storage order (no shuffle)"}
    if s.variant:
        names["variant"] = f"block order, block {s.variant[0]} / window {s.variant[1]}"
    for o, rs in by.items():
        if rs:
            per = [statistics.fmean(100 * r.iou[c] for r in rs) for c in CLASS_NAMES]
            lines.append(
                f"| {names[o]} | "
                + " | ".join(f"{v:.1f}" for v in per)
                + f" | {statistics.fmean(r.clips_per_batch for r in rs):.1f} | {statistics.fmean(r.photos_per_batch for r in rs):.1f}"
                + f" | {statistics.fmean(r.loss[-1] for r in rs):.3f} |"
            )
    for title, key, scale, fmt in (("Held-out mIoU", "curve", 100, ".1f"), ("Training loss", "loss", 1, ".3f")):
        lines += ["", f"{title} after each epoch (mean over seeds):", "",
                  "| order | " + " | ".join(str(e + 1) for e in range(s.epochs)) + " |", "|---|" + "---|" * s.epochs]  # fmt: skip
        for o, rs in by.items():
            if rs:
                curve = [statistics.fmean(scale * getattr(r, key)[e] for r in rs) for e in range(s.epochs)]
                lines.append(
                    f"| {names[o]} ({len(rs)} seed{'s' if len(rs) > 1 else ''}) | "
                    + " | ".join(f"{v:{fmt}}" for v in curve)
                    + " |"
                )
    lines += [
        "",
        "## Dataset",
        "",
        f"`{url}`: {s.train_rows + s.val_rows} rows of {s.size}×{s.size} JPEG q90 + lz4 masks from the 7 scikit-image "
        f"photographs of `benchmarks/testbeds/photos.py` (seed {DATA_SEED}); masks: 4 classes, the quartiles of the "
        "image's blurred luminance (`photo_sample`'s). "
        f"**Training rows [0, {s.train_rows}) are written in collection order: {s.train_rows // s.clip} video-like clips of "
        f"{s.clip} consecutive frames** (one view of a photo panning by up to half its side, one scale, mirroring and "
        "exposure per clip, fresh sensor noise per frame), **the clips sorted by source photograph** "
        f"({', '.join(f'{p} {c // s.clip}' for p, c in zip(PHOTOS, runs_per_photo, strict=True))} clips, in that order): "
        "neighbouring rows are near-duplicates, as frames of one video or tiles of one slide are. "
        f"Held-out rows [{s.train_rows}, {s.train_rows + s.val_rows}): independent `photo_sample` crops of the same photos "
        "(each its own scale, position and exposure), read in order. "
        + (f"Made once in {made_s:.0f} s and kept." if made_s else "Made by an earlier run and kept."),
        "",
        "## Settings and scaling",
        "",
        "The default block order on Deep Lake is block 64 / window 1,024 on datasets of 100,000s of rows. Here "
        f"it is scaled to the {s.train_rows}-row training split keeping its shape: block {s.block} / window {s.window}, "
        f"the same {s.window // s.block} blocks mixed per batch of {s.batch}, the dataset "
        f"{s.train_rows / s.window:.0f} windows long. A block is {s.block} consecutive frames of one clip, so a "
        f"block-order batch holds about {s.batch * s.block // s.window}-{s.batch * s.block // s.window + 1} near-duplicate "
        "frames of each clip it draws from, and draws from fewer clips than a full shuffle's (the table above). "
        "The clips sorted by photo change nothing for the blocks (they come in a random order), only for reading in "
        "storage order. "
        "Same for both orders: rows, model, initialisation per seed, optimizer, batch, epochs and steps, "
        f"seeds {', '.join(map(str, s.seeds))} (weights and loader). No augmentation. Runs of the two orders alternate.",
        "",
        "## Time per run",
        "",
        "| order | seed | training s | run s (incl. evaluation each epoch) |",
        "|---|---|---|---|",
        *[f"| {names[r.order]} | {r.seed} | {r.train_s:.0f} | {r.wall_s:.0f} |" for r in runs],
        "",
        f"Machine: {os.cpu_count()} cores, shared with other jobs while it ran (`nice -n 5`; the run times follow their load, "
        "not the order); "
        f"{platform.python_implementation()} {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, CPU only.",
    ]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "training_quality.md").write_text(text)
    doc = {
        "settings": asdict(s), "dataset": {"url": url, "rows_per_photo": dict(zip(PHOTOS, runs_per_photo, strict=True)),
        "order": "training rows sorted by source photo", "made_s": made_s},
        "full": full, "block": block, "difference_points": diff, "paired_differences_points": paired,
        "runs": [asdict(r) for r in runs], "cpus": os.cpu_count(), "torch": torch.__version__,
    }  # fmt: skip
    (out / "training_quality.json").write_text(json.dumps(doc, indent=1))
    return text


def settings_of(doc: dict[str, Any]) -> Settings:
    """The ``Settings`` a report's JSON was made with (JSON has lists where they have tuples)."""
    d = doc["settings"]
    return Settings(**{**d, "seeds": tuple(d["seeds"]), "variant": tuple(d["variant"]) if d.get("variant") else None})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    ap.add_argument("--train-rows", type=int, default=d.train_rows)
    ap.add_argument("--val-rows", type=int, default=d.val_rows)
    ap.add_argument("--size", type=int, default=d.size)
    ap.add_argument("--clip", type=int, default=d.clip)
    ap.add_argument("--epochs", type=int, default=d.epochs)
    ap.add_argument("--block", type=int, default=d.block)
    ap.add_argument("--window", type=int, default=d.window)
    ap.add_argument("--seeds", type=int, nargs="+", default=list(d.seeds))
    ap.add_argument("--control", action="store_true", help="add one run in storage order (no shuffle), seed 0")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/large"))
    ap.add_argument("--from-json", help="rewrite the report from a training_quality.json, training nothing")
    ap.add_argument("--variant", type=int, nargs=2, metavar=("BLOCK", "WINDOW"), help="a second block order to try")
    ap.add_argument("--orders", nargs="+", default=["full", "block"], choices=["full", "block", "variant"])
    ap.add_argument("--merge", help="a training_quality.json of the same settings whose runs join this report")
    a = ap.parse_args(argv)
    if a.from_json:  # the report's wording changes without hours of training again
        doc = json.loads(Path(a.from_json).read_text())
        s = settings_of(doc)
        _, photo = layout(s)
        runs = [Run(**r) for r in doc["runs"]]
        photos = np.repeat(np.array(photo), s.clip)
        print(report(runs, s, doc["dataset"]["url"], photos, doc["dataset"]["made_s"], Path(a.out)))
        return 0
    s = Settings(
        train_rows=a.train_rows, val_rows=a.val_rows, size=a.size, clip=a.clip, epochs=a.epochs, block=a.block, window=a.window,
        seeds=tuple(a.seeds), variant=tuple(a.variant) if a.variant else None,
    )  # fmt: skip
    merged: list[Run] = []
    if a.merge:
        doc = json.loads(Path(a.merge).read_text())
        merged = [Run(**r) for r in doc["runs"]]
        same = ("seeds", "variant")  # what may differ between the merged runs and these
        if {**asdict(settings_of(doc)), **{k: None for k in same}} != {**asdict(s), **{k: None for k in same}}:
            raise SystemExit(f"--merge {a.merge}: its runs had other settings than these")
    path = ROOT / f"data/bench/photo-clips-{s.size}px-{s.train_rows // s.clip}x{s.clip}+{s.val_rows}-jpg"
    url = f"file://{path}"
    t0 = time.perf_counter()
    existed = path.exists()
    rows = make_data(url, s)
    made_s = 0.0 if existed else time.perf_counter() - t0
    if a.merge and not made_s:  # the merged runs' report said how long the making took
        made_s = float(json.loads(Path(a.merge).read_text())["dataset"]["made_s"])
    source = DeepLakeSource(url, ("images", "masks"))
    runs: list[Run] = list(merged)
    plan = [(o, seed) for seed in s.seeds for o in a.orders] + ([("storage", 0)] if a.control else [])
    for k, (order, seed) in enumerate(plan):
        if order == "variant" and s.variant is None:
            raise SystemExit("--orders variant needs --variant BLOCK WINDOW")
        print(f"run {k + 1}/{len(plan)}: {order} seed {seed}", flush=True)
        runs.append(train_run(order, seed, source, rows, s))
        r = runs[-1]
        print(
            f"run {k + 1}/{len(plan)} done: {order} seed {seed} mIoU {100 * r.miou:.1f} in {r.wall_s:.0f} s", flush=True
        )
        # after every run: a cut-short experiment keeps what finished
        report(runs, s, url, rows[1], made_s, Path(a.out))
    print(report(runs, s, url, rows[1], made_s, Path(a.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
