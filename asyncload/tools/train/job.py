"""The training run: epochs, evaluation, checkpoints and resume, and the command line."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict
from itertools import islice
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from ...device import DeviceFeed
from ...errors import ConfigError
from ...runtime.settings import check
from ...sources.deeplake import normalize_url
from ..train_args import add_train_flags, config_from_namespace
from .classes import Classes, resolve_classes
from .classes import describe as describe_classes
from .config import TrainConfig
from .data import Split, dataset_source, describe, first_n, source_kwargs
from .model import UNet
from .steps import SYNC_EVERY, StepOptions, StepTimes, iou_counts, model_only_rate, timed_steps, train_step
from .world import World, make_world


def _ensure_data(cfg: TrainConfig, w: World) -> str:
    """The dataset URL; rank 0 writes the synthetic dataset first when it is missing and allowed to."""
    import deeplake

    from ..synthetic import make_dataset

    url = normalize_url(cfg.data)
    if w.main and cfg.make_data and not deeplake.exists(url, **_exists_creds(cfg)):
        rows, side, sizes = cfg.rows or 1200, cfg.image_size, cfg.make_sizes
        what = f"{side}x{side}" if sizes is None else f"photo-like, long side {sizes[0]}-{sizes[1]} px"
        formats = f"{cfg.make_format} + {cfg.make_mask_format} masks"
        print(f"making {rows} synthetic rows ({what}, {formats}) at {url}", flush=True)
        make_dataset(
            url, rows, height=side, width=side, image_format=cfg.make_format, sizes=cfg.make_sizes,
            aspect=cfg.make_aspect, mask_format=cfg.make_mask_format, seed=cfg.seed, progress=cfg.progress,
            creds=source_kwargs(cfg)["creds"],
        )  # fmt: skip
    w.barrier()
    return url


def _exists_creds(cfg: TrainConfig) -> dict[str, Any]:
    """``deeplake.exists``'s keywords for the config's credentials (a profile is resolved at open)."""
    kw = source_kwargs(cfg)
    return {k: v for k, v in (("creds", kw["creds"]), ("token", kw["token"])) if v}


def _save(path: str, state: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _loader_state(loader: Any, consumed: int) -> dict[str, Any] | None:
    """The loader's resume point after ``consumed`` batches of the current epoch, when it offers one.

    ``AsyncIterableDataset.state_dict(batches_consumed)`` is told the count (only the training loop
    knows what DataLoader handed out); a loader that tracks it itself takes no argument."""
    fn = getattr(loader, "state_dict", None)
    if fn is None:
        return None
    if "batches_consumed" in inspect.signature(fn).parameters:
        return dict(fn(batches_consumed=consumed))
    return dict(fn())


def train(cfg: TrainConfig, on_step: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Run the training job of ``cfg``; returns one dict of figures per epoch run (the same on all ranks).

    ``on_step`` (optional) is called after every optimizer step with ``{"epoch", "step", "loss",
    "indices"}``; an exception raised there stops the run like a crash would (checkpoints stay)."""
    w = make_world(cfg)
    threads = torch.get_num_threads()
    benchmark = torch.backends.cudnn.benchmark
    try:
        if cfg.threads:
            torch.set_num_threads(cfg.threads)  # process-wide: put back below for in-process callers
        with contextlib.ExitStack() as stack:  # closes the splits' loaders (processes=K: stops the workers)
            return _run(cfg, w, on_step, stack)
    finally:
        torch.set_num_threads(threads)
        torch.backends.cudnn.benchmark = benchmark
        if w.owns_group:
            dist.destroy_process_group()


def _run(
    cfg: TrainConfig, w: World, on_step: Callable[[dict[str, Any]], None] | None, stack: contextlib.ExitStack
) -> list[dict[str, Any]]:
    from tqdm import tqdm

    url = _ensure_data(cfg, w)
    total = len(dataset_source(cfg, url))  # opens it: a missing dataset or column is named here
    n = min(cfg.rows, total) if cfg.rows else total
    n_train = int(n * (1 - cfg.holdout))
    check(
        "holdout", cfg.holdout, 0 < n_train < n, f"a fraction that leaves rows on both sides of the split of {n} rows"
    )
    classes = resolve_classes(dataset_source(cfg, url, (cfg.mask_column,)), n, cfg.classes, cfg.class_names)
    dtype = torch.bfloat16 if cfg.bf16 and w.device.type == "cuda" else torch.float32  # model-ready images
    train_split = stack.enter_context(
        contextlib.closing(Split(cfg, url, 0, n_train, train=True, rank=w.rank, world=w.world, image_dtype=dtype))
    )
    val_split = stack.enter_context(
        contextlib.closing(Split(cfg, url, n_train, n, train=False, rank=w.rank, world=w.world, image_dtype=dtype))
    )
    steps = len(train_split) if not cfg.max_steps_per_epoch else min(cfg.max_steps_per_epoch, len(train_split))

    how = StepOptions.for_device(w.device, cfg.bf16, cfg.channels_last, cfg.cudnn_benchmark)
    torch.manual_seed(cfg.seed)
    net = UNet(len(classes), cfg.width).to(w.device, memory_format=how.memory_format)
    model: nn.Module = net
    if w.world > 1:
        model = nn.parallel.DistributedDataParallel(
            net, device_ids=[w.device.index] if w.device.type == "cuda" else None
        )
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)

    epoch, step, skip = 0, 0, 0
    loader_state_restored = False
    if cfg.checkpoint and cfg.resume and os.path.exists(cfg.checkpoint):
        ck = torch.load(cfg.checkpoint, map_location=w.device, weights_only=True)
        net.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        epoch, step, skip = int(ck["epoch"]), int(ck["step"]), int(ck["step_in_epoch"])
        if ck.get("loader") is not None and hasattr(train_split.dataset, "load_state_dict"):
            train_split.dataset.load_state_dict(ck["loader"])
            loader_state_restored = True
        if w.main:
            print(
                f"resumed from {cfg.checkpoint}: epoch {epoch + 1}, step {step} ({skip} steps into the epoch)",
                flush=True,
            )

    def save(epoch_: int, in_epoch: int) -> None:
        if w.main and cfg.checkpoint:
            loader_state = _loader_state(train_split.dataset, in_epoch) if in_epoch else None
            _save(cfg.checkpoint, {
                "model": net.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch_, "step": step,
                "step_in_epoch": in_epoch, "loader": loader_state, "config": asdict(cfg),
            })  # fmt: skip
        w.barrier()  # nobody runs ahead of a checkpoint that may be needed to restart them

    if w.main:
        print(
            f"training a U-Net (width {cfg.width}) on {n_train} rows, validating on {n - n_train}, of {url}; "
            f"loader {cfg.loader}{f' (processes={cfg.processes})' if cfg.processes else ''}, {w.world} rank(s) on {w.device}, {steps} steps/epoch of {cfg.batch_size} per rank; "
            f"bf16 {how.bf16}, channels_last {how.channels_last}; "
            f"train: {describe(train_split.augment)}, validate: {describe(val_split.augment)}; "
            f"columns {cfg.image_column!r} and {cfg.mask_column!r}, {describe_classes(classes)}",
            flush=True,
        )
    history: list[dict[str, Any]] = []
    first_epoch = epoch
    kept: dict[str, torch.Tensor] | None = None  # a full batch on the device, for the model-only rate
    for epoch in range(first_epoch, cfg.epochs):
        start = skip if epoch == first_epoch else 0  # only a resumed epoch begins part-way
        model.train()
        raw = train_split.epoch(epoch)
        if start and not loader_state_restored:
            deque(islice(raw, start), maxlen=0)  # the order is deterministic: skip what was trained already
        feed = DeviceFeed(first_n(raw, steps - start), w.device, depth=cfg.depth)
        bar = tqdm(total=steps, initial=start, desc=f"epoch {epoch + 1}/{cfg.epochs}", unit="step",
                   disable=not (w.main and cfg.progress), leave=False)  # fmt: skip
        loss_sum = torch.zeros((), dtype=torch.float64, device=w.device)
        seen: list[int] = []

        def one_step(batch: dict[str, torch.Tensor]) -> torch.Tensor:
            nonlocal kept
            if kept is None or len(batch["images"]) > len(kept["images"]):
                kept = batch
            return train_step(model, opt, batch["images"], batch["masks"], how)

        def after(  # this epoch's state bound as defaults: the function is made anew each epoch
            batch: dict[str, torch.Tensor], loss: torch.Tensor, times: StepTimes,
            epoch: int = epoch, start: int = start, loss_sum: torch.Tensor = loss_sum, seen: list[int] = seen,
            bar: Any = bar,
        ) -> None:  # fmt: skip
            nonlocal step
            step += 1
            in_epoch = start + times.steps
            loss_sum.add_(loss.double() * len(batch["images"]))
            if times.steps % SYNC_EVERY == 0 and not bar.disable:
                bar.set_postfix(loss=f"{loss.item():.3f}")  # already read back this step: costs nothing
            # Reading indices back to the host waits for the device: only when asked for.
            idx = batch["index"].tolist() if (cfg.index_log or on_step is not None) else []
            seen.extend(idx)
            bar.update(1)
            if on_step is not None:
                on_step({"epoch": epoch, "step": step, "loss": float(loss), "indices": idx})
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and in_epoch < steps:
                save(epoch, in_epoch)

        try:
            times = timed_steps(feed, one_step, w.device, after)
        except IndexError as exc:  # cross_entropy: "Target 5 is out of bounds."
            if "out of bounds" not in str(exc):
                raise
            raise ConfigError(
                f"classes={len(classes)} is not allowed for this data: column {cfg.mask_column!r} holds a class id "
                f"of {len(classes)} or more ({exc}); the count came from {classes.origin}: set classes (--classes N)"
            ) from None
        bar.close()
        feed.close()
        if cfg.index_log:
            os.makedirs(cfg.index_log, exist_ok=True)
            with open(os.path.join(cfg.index_log, f"rank{w.rank}.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps({"epoch": epoch, "rank": w.rank, "world_size": w.world, "indices": seen}) + "\n")

        ious, ev_s = _evaluate(net, val_split, w, how, classes)
        loss_total, n_samples, wait_total, sync_total, wall_total = w.sum(
            [float(loss_sum), times.samples, times.wait_s, times.sync_s, times.wall_s]
        )
        present = [i for i in ious if not math.isnan(i)]
        row: dict[str, Any] = {
            "epoch": epoch,
            "step": step,
            "steps": steps - start,
            "loss": loss_total / max(n_samples, 1),
            "miou": sum(present) / len(present) if present else float("nan"),
            "iou": dict(zip(classes.names, ious, strict=True)),
            "samples": int(n_samples),
            "samples_per_s": n_samples / (wall_total / w.world) if wall_total else 0.0,
            "data_wait": wait_total / wall_total if wall_total else 0.0,
            "device_sync": sync_total / wall_total if wall_total else 0.0,
            "train_s": wall_total / w.world,
            "eval_s": ev_s,
        }
        history.append(row)
        if w.main:
            print(
                f"epoch {epoch + 1}/{cfg.epochs}  step {step}  loss {row['loss']:.4f}  mIoU {row['miou']:.3f} "
                f"({', '.join(f'{c} {v:.2f}' for c, v in row['iou'].items())})  "
                f"{row['samples_per_s']:,.0f} samples/s  data wait {100 * row['data_wait']:.1f}%, "
                f"device sync {100 * row['device_sync']:.1f}% of step time  "
                f"({row['train_s']:.1f} s train, {ev_s:.1f} s eval)",
                flush=True,
            )
        save(epoch + 1, 0)
    if w.main and not history:
        print(f"nothing to do: the checkpoint {cfg.checkpoint} is already at epoch {epoch} of {cfg.epochs}", flush=True)
    if history and kept is not None and cfg.model_only_steps:
        (rate,) = w.sum([model_only_rate(model, opt, kept, how, cfg.model_only_steps)])
        last = history[-1]
        last["model_only_samples_per_s"] = rate  # summed over ranks, like samples_per_s
        last["of_model_only"] = last["samples_per_s"] / rate if rate else 0.0
        if w.main:
            print(
                f"model alone (one batch already on {w.device}, same step loop): {rate:,.0f} samples/s; "
                f"training ran at {100 * last['of_model_only']:.0f}% of it in its last epoch",
                flush=True,
            )
    return history


@torch.no_grad()
def _evaluate(net: nn.Module, split: Split, w: World, how: StepOptions, classes: Classes) -> tuple[list[float], float]:
    """Per-class IoU over the held-out split, each row counted once across ranks; and the seconds taken."""
    t0 = time.perf_counter()
    net.eval()
    k = len(classes)
    counts = torch.zeros(2 * k, dtype=torch.float64, device=w.device)
    left = split.real
    with DeviceFeed(split.epoch(0), w.device) as feed:
        for batch in feed:
            keep = min(left, len(batch["images"]))
            left -= keep
            if keep:
                with how.autocast():
                    logits = net(how.inputs(batch["images"]))
                counts += iou_counts(logits, batch["masks"], keep, k)
    net.train()
    total = w.sum(counts.cpu().tolist())
    ious = [total[c] / total[k + c] if total[k + c] else float("nan") for c in range(k)]
    return ious, time.perf_counter() - t0


# -- entry points ----------------------------------------------------------------------------------


def config_from_args(argv: Sequence[str] | None = None) -> TrainConfig:
    """``--config FILE|NAME`` (default: the shipped ``train_unet``), the flags, ``--set key=value``."""
    p = argparse.ArgumentParser(prog="asyncload train", description="Train a compact U-Net on a segmentation dataset.")
    add_train_flags(p)
    return config_from_namespace(p.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse, train, and turn a configuration mistake into one line and exit code 2."""
    try:
        cfg = config_from_args(argv)
        train(cfg)
    except ConfigError as exc:
        print(f"asyncload train: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
