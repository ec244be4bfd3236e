"""GPU benchmark for issue 12: the cost of getting batches to the GPU, and training against the model alone.

    python benchmarks/suites/gpu_feed.py --out benchmarks/results/gpu [--rows 2000] [--data /tmp/seg256]

Everything is measured in one process, in one run, so the rows compare (a 16-core machine's loader
throughput moves by tens of percent between runs, see issue 12):

1. **Delivery**: one ``AsyncLoader`` epoch of 256x256 PNG images + masks (a local Deep Lake dataset),
   consumed three ways, alternating, ``--repeats`` times each: CPU tensors (no copy), a plain pageable
   ``.cuda()`` on the training thread, and ``DeviceFeed("cuda")`` (pin thread, side-stream copies).
   Samples/s from the first batch to the last (``measure``).
2. **The data-wait figure**: the training step loop fed batches already on the GPU through
   ``DeviceFeed`` must report about 0% data wait.
3. **Training**: the U-Net job (width 32, 256x256) fed by asyncload, bf16 + channels_last and fp32; its
   samples/s, data wait and device sync per epoch, and the model-only rate measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncload import AsyncLoader, DeepLakeSource, make_dataset
from asyncload.device import DeviceFeed
from asyncload.tools.measure import Measurement, measure
from asyncload.tools.synthetic import CLASSES
from asyncload.tools.train import StepOptions, TrainConfig, UNet, sync, timed_steps, train, train_step


def machine() -> dict[str, Any]:
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        ).stdout.strip()  # fmt: skip
    except OSError:
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return {"gpu": gpu, "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def pageable(loader: AsyncLoader, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """The plain way: a synchronous ``.cuda()`` from pageable memory on the training thread."""
    for b in loader:
        yield {k: v.to(device) for k, v in b.items()}


def delivery(url: str, repeats: int, concurrency: int, device: torch.device) -> list[Measurement]:
    def loader(seed: int) -> AsyncLoader:
        return AsyncLoader(DeepLakeSource(url), batch_size=64, shuffle=True, seed=seed, concurrency=concurrency)

    measure("warm-up (page cache)", loader(99))
    out = []
    for r in range(repeats):
        out.append(measure("CPU tensors, no copy", loader(r)))
        out.append(measure("pageable .cuda() on the training thread", pageable(loader(r), device)))
        with DeviceFeed(loader(r), device) as feed:
            out.append(measure("DeviceFeed('cuda'): pin thread, side stream", feed))
        sync(device)
    return out


def staging_copy_cost(copies: int = 40) -> dict[str, dict[str, float]]:
    """A batch of 64 images (12 MiB) copied into pinned memory: wall and CPU (all threads) per copy,
    torch's ``copy_`` against numpy's single-threaded ``copyto``."""
    src = torch.randint(0, 256, (64, 256, 256, 3), dtype=torch.uint8)
    dst = torch.empty_like(src, pin_memory=torch.cuda.is_available())
    out = {}
    for name, copy in (
        ("torch copy_", lambda: dst.copy_(src)),
        ("numpy copyto", lambda: np.copyto(dst.numpy(), src.numpy())),
    ):
        copy()
        t = os.times()
        c0, t0 = t.user + t.system, time.perf_counter()
        for _ in range(copies):
            copy()
        t = os.times()
        out[name] = {
            "wall_ms": 1e3 * (time.perf_counter() - t0) / copies,
            "cpu_ms": 1e3 * (t.user + t.system - c0) / copies,
        }
    return out


def wait_on_resident(url: str, device: torch.device, steps: int = 60) -> dict[str, float]:
    """The step loop fed batches already on the GPU: its data-wait figure must be about 0."""
    how = StepOptions.for_device(device, bf16=True, channels_last=True, cudnn_benchmark=True)
    model = UNet(len(CLASSES), 32).to(device, memory_format=how.memory_format)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with DeviceFeed(AsyncLoader(DeepLakeSource(url), batch_size=32), device) as feed:
        batch = next(feed)

    def step(b: dict[str, torch.Tensor]) -> torch.Tensor:
        return train_step(model, opt, b["images"], b["masks"], how)

    timed_steps(iter([batch] * 10), step, device)  # warm-up
    with DeviceFeed([batch] * steps, device) as resident:
        t = timed_steps(resident, step, device)
    return {"samples_per_s": t.samples_per_s, "data_wait": t.wait_s / t.wall_s, "device_sync": t.sync_s / t.wall_s}


def training(
    url: str, fast: bool, epochs: int, concurrency: int, device: torch.device, **loader: Any
) -> list[dict[str, Any]]:
    """``loader``: TrainConfig's loader settings, e.g. ``decode="cuda", model_ready=True`` (issue 23: the
    GPU decodes images and lz4 masks and delivers normalized NCHW bf16; the step converts nothing)."""
    if device.type != "cuda" and loader.get("decode", "").startswith("cuda"):
        loader["decode"] = "cpu"  # the smoke test on a machine without a GPU
    cfg = TrainConfig(
        data=url, make_data=False, rows=0, width=32, batch_size=32, epochs=epochs,
        concurrency=concurrency, device=str(device), checkpoint=None, progress=False, model_only_steps=40,
        bf16=fast, channels_last=fast, **loader,
    )  # fmt: skip
    return train(cfg)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--data", default="/tmp/seg256")
    p.add_argument("--rows", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--size", type=int, default=256)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    a = p.parse_args()
    device = torch.device(a.device)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not Path(a.data).exists():
        make_dataset(a.data, a.rows, height=a.size, width=a.size, progress=False)
    made_s = time.perf_counter() - t0
    url = DeepLakeSource(a.data).url
    result: dict[str, Any] = {"machine": machine(), "rows": a.rows, "size": a.size, "dataset_made_s": made_s}
    result["staging_copy"] = staging_copy_cost()
    result["delivery"] = [m.as_dict() for m in delivery(url, a.repeats, a.concurrency, device)]
    result["resident"] = wait_on_resident(url, device)
    result["train_bf16_channels_last"] = training(url, True, a.epochs, a.concurrency, device)
    result["train_fp32"] = training(url, False, a.epochs, a.concurrency, device)
    result["train_cuda_model_ready"] = training(
        url, True, a.epochs, a.concurrency, device, decode="cuda", model_ready=True
    )
    (out / "gpu_feed.json").write_text(json.dumps(result, indent=1, default=str))
    (out / "gpu_feed.md").write_text(report(result))
    print(report(result))


def report(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"# GPU feed and training ({m['gpu']}; {m['cpus']} CPUs; Python {m['python']}; torch {m['torch']})",
        "",
        f"{r['rows']} rows of {r['size']}x{r['size']} PNG images + lz4 masks, local Deep Lake dataset; one process, one run.",
        "",
        "## Delivery (one AsyncLoader epoch, batch 64, concurrency fixed; alternating runs)",
        "",
        "| consumer | samples/s (first to last batch) | first batch s | CPU ms/sample |",
        "|---|---|---|---|",
    ]
    for d in r["delivery"]:
        lines.append(
            f"| {d['name']} | {d['samples_per_s']:,.0f} | {d['first_batch_s']:.3f} | {d['cpu_per_sample_ms']:.2f} |"
        )
    lines += [
        "",
        "## Staging copy of one batch of 64 images (12 MiB) into pinned memory",
        "",
        "| copy | wall ms | CPU ms (all threads) |",
        "|---|---|---|",
    ]
    for name, c in r["staging_copy"].items():
        lines.append(f"| {name} | {c['wall_ms']:.2f} | {c['cpu_ms']:.2f} |")
    res = r["resident"]
    lines += [
        "",
        "## The data-wait figure with batches already on the GPU (step loop of the training job)",
        "",
        f"{res['samples_per_s']:,.0f} samples/s; data wait {100 * res['data_wait']:.2f}%; "
        f"device sync {100 * res['device_sync']:.1f}%",
        "",
        "## Training (U-Net width 32, batch 32, fed by asyncload through DeviceFeed)",
        "",
        "| precision | epoch | samples/s | data wait | device sync | model alone, samples/s | of model alone |",
        "|---|---|---|---|---|---|---|",
    ]
    runs = (
        ("train_bf16_channels_last", "bf16 + channels_last"),
        ("train_fp32", "fp32"),
        ("train_cuda_model_ready", "bf16 + channels_last, decode=cuda, model-ready NCHW bf16 batches"),
    )
    for key, label in runs:
        for row in r.get(key, []):
            alone = row.get("model_only_samples_per_s")
            ceiling = f"{alone:,.0f} | {100 * row['of_model_only']:.0f}%" if alone else "- | -"
            lines.append(
                f"| {label} | {row['epoch'] + 1} | {row['samples_per_s']:,.0f} | {100 * row['data_wait']:.1f}% | "
                f"{100 * row['device_sync']:.1f}% | {ceiling} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
