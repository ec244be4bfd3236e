"""Issue 19's GPU target: JPEG + mask pairs delivered into GPU memory from local disk, in one run.

    python benchmarks/suites/gpu_decode.py --rows 16000 --out benchmarks/results/gpu_decode

Data: photo-like 256×256 JPEG (q90) + lz4 masks (``testbeds/photos.py``), written here. Each row of the
table is one whole shuffled epoch in this process, open to last sample, the batches' images on the GPU
(``torch.cuda.synchronize`` before the clock stops); CPU seconds are the whole process tree's (fan-out
workers included, from /proc). Also measured, as ceilings: nvJPEG alone on the same bytes, libjpeg-turbo
alone on one core, and Deep Lake's ``get_bytes`` of the whole column.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from asyncload import AsyncLoader, DeepLakeSource, DeviceFeed  # noqa: E402
from asyncload.tools.measure import _children  # noqa: E402

CLK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    pid = pid or os.getpid()
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLK
        except OSError:
            pass
    return total


def _make_rows(args: tuple[int, int]) -> list[tuple[bytes, np.ndarray]]:
    from benchmarks.testbeds.photos import encode, photo_sample

    start, n = args
    out = []
    for i in range(start, start + n):
        img, mask = photo_sample(np.random.default_rng([0, i]), 256)
        out.append((encode(img, "jpg"), mask))
    return out


def make_data(path: str, rows: int) -> str:
    import multiprocessing as mp

    import deeplake

    url = "file://" + path
    if os.path.exists(path):
        return url
    chunks = [(s, min(500, rows - s)) for s in range(0, rows, 500)]
    with mp.get_context("spawn").Pool(max(1, (os.cpu_count() or 2) - 1)) as pool:
        parts = pool.map(_make_rows, chunks)
    ds = deeplake.create(url)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="lz4"))
    for part in parts:
        ds.append({"images": [p[0] for p in part], "masks": np.stack([p[1] for p in part])})
    ds.commit()
    del ds
    return url


GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"  # (without a GPU: a dry run of the script on the CPU decode path)


def one_epoch(
    name: str, url: str, feed: bool = False, columns: tuple[str, ...] = ("images", "masks"), **opts: Any
) -> dict[str, Any]:
    """The first epoch from the loader's creation (cold: worker processes start in it), then a second
    epoch of the same loader, reported apart."""
    if not GPU and opts.get("decode") == "cuda":
        opts["decode"] = "cpu"
    c0, t0 = tree_cpu_s(), time.perf_counter()
    loader = AsyncLoader(
        DeepLakeSource(url, columns=columns), opts.pop("batch_size", 256), shuffle=True, seed=0, **opts
    )
    row: dict[str, Any] = {"reader": name}
    for epoch in (0, 1):
        if epoch:
            c0, t0 = tree_cpu_s(), time.perf_counter()
        loader.set_epoch(epoch)
        n, first = 0, None
        batches = DeviceFeed(loader, device=DEVICE) if feed else loader
        for b in batches:
            n += len(b["index"])
            if first is None:
                first = time.perf_counter() - t0
            assert b["images"].device.type == DEVICE or not (feed or opts.get("decode") == "cuda")
        if GPU:
            torch.cuda.synchronize()
        wall, cpu = time.perf_counter() - t0, tree_cpu_s() - c0
        if hasattr(batches, "close"):
            batches.close()
        key = "" if epoch == 0 else "epoch2_"
        row.update(
            {f"{key}samples_per_s": n / wall, f"{key}cpu_ms_per_sample": 1e3 * cpu / n, f"{key}first_batch_s": first}
        )
        row.setdefault("samples", n)
    st = loader.stats()
    loader.close()
    row.update({"cpu_decode_s": st.get("cpu_decode_s"), "bytes_held_peak_mb": st.get("bytes_held_peak", 0) / 2**20})
    print(json.dumps(row), flush=True)
    return row


def ceilings(url: str, n: int) -> dict[str, float]:
    import deeplake
    import simplejpeg
    from torchvision.io import ImageReadMode, decode_jpeg

    ds = deeplake.open_read_only(url)
    t = time.perf_counter()
    blobs = ds["images"].get_bytes(list(range(n)))
    get_bytes = n / (time.perf_counter() - t)
    t = time.perf_counter()
    ds["masks"][list(range(n))]
    masks = n / (time.perf_counter() - t)
    data = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
    decode_jpeg(data[:256], mode=ImageReadMode.RGB, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    for s in range(0, n, 256):
        decode_jpeg(data[s : s + 256], mode=ImageReadMode.RGB, device="cuda")
    torch.cuda.synchronize()
    nvjpeg = n / (time.perf_counter() - t)
    t = time.perf_counter()
    for b in blobs[:2000]:
        simplejpeg.decode_jpeg(b)
    turbo = 2000 / (time.perf_counter() - t)
    out = {"get_bytes_images_per_s": get_bytes, "deeplake_masks_per_s": masks, "nvjpeg_batched_per_s": nvjpeg,
           "libjpeg_turbo_one_core_per_s": turbo, "jpeg_kb": float(np.mean([len(b) for b in blobs])) / 1e3}  # fmt: skip
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16000)
    ap.add_argument("--data", default="/tmp/gpu-decode-jpeg")
    ap.add_argument("--out", default="benchmarks/results/gpu_decode")
    ap.add_argument("--quick", action="store_true", help="fewer configurations")
    ap.add_argument("--match", default="", help="only the configurations whose name contains this")
    args = ap.parse_args()
    t = time.perf_counter()
    url = make_data(args.data, args.rows)
    print(f"data: {args.rows} rows in {time.perf_counter() - t:.0f} s", flush=True)
    result: dict[str, Any] = {
        "machine": {
            "gpu": torch.cuda.get_device_name(0) if GPU else "none (dry run)",
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },  # fmt: skip
        "rows": args.rows,
        "ceilings": ceilings(url, min(args.rows, 8000)) if GPU else {"jpeg_kb": 0.0},
        "runs": [],
    }
    col = {"read_mode": "column", "request_size": 256, "batch_size": 256}
    configs: list[tuple[str, dict[str, Any]]] = [
        ("decode=cuda, in-process, column reads", {"decode": "cuda", **col}),
        ("decode=cuda, in-process, column reads, images only", {"decode": "cuda", "columns": ("images",), **col}),
        ("decode=cuda, processes=4, column reads", {"decode": "cuda", "processes": 4, **col}),
        ("decode=cpu, in-process, column reads + DeviceFeed", {"decode": "cpu", "feed": True, **col}),
        ("decode=cpu, processes=8, column reads + DeviceFeed", {"decode": "cpu", "processes": 8, "feed": True, **col}),
        ("decode=store, in-process, column reads + DeviceFeed", {"decode": "store", "feed": True, **col}),
        ("decode=cuda, in-process, default row reads", {"decode": "cuda", "batch_size": 256}),
        ("decode=cuda, in-process, column reads of 64, 2048 in flight",
         {"decode": "cuda", "read_mode": "column", "request_size": 64, "batch_size": 256, "max_concurrency": 2048}),
        ("decode=cuda, in-process, column reads of 32, 2048 in flight",
         {"decode": "cuda", "read_mode": "column", "request_size": 32, "batch_size": 256, "max_concurrency": 2048}),
    ]  # fmt: skip
    # Issue 23: pairs made model-ready on the device (crop, flip, normalize, NCHW bf16), and DALI on the same
    # bytes with the same crop and flip (``dali_peer``), in the same run.
    from asyncload import RandomHorizontalFlip, RandomResizedCrop

    peer_ops = [RandomResizedCrop(224, scale=(0.25, 1.0)), RandomHorizontalFlip()]
    ready = {"normalize": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), "layout": "NCHW", "dtype": torch.bfloat16}
    configs.insert(0, ("decode=cuda, model-ready pairs (crop 224, flip, normalize, NCHW bf16), column reads",
                       {"decode": "cuda", "augment": peer_ops, **ready, **col}))  # fmt: skip
    if args.match:
        configs = [c for c in configs if args.match in c[0]]
    if args.quick:
        configs = configs[:2]
    for name, opts in configs:
        try:
            result["runs"].append(one_epoch(name, url, **opts))
        except Exception as exc:  # noqa: BLE001 - recorded, the next configuration still runs
            print(f"{name}: {type(exc).__name__}: {exc}", flush=True)
            result["runs"].append({"reader": name, "error": f"{type(exc).__name__}: {exc}"})
    from benchmarks.suites.dali_peer import dali_available, dali_epoch

    if GPU and dali_available() and (not args.match or "DALI" in args.match):
        try:
            result["runs"].append(dali_epoch(url, 256, (224, 224), peer_ops, tree_cpu_s) | {"epoch2_samples_per_s": 0.0,
                                  "epoch2_cpu_ms_per_sample": 0.0, "first_batch_s": 0.0})  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - recorded beside the asyncload rows
            result["runs"].append({"reader": "NVIDIA DALI", "error": f"{type(exc).__name__}: {exc}"})
    else:
        print("NVIDIA DALI: not importable or no GPU; its row is left out", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    lines = [f"# JPEG + lz4 mask pairs into GPU memory, local disk: {result['machine']['gpu']}, {result['machine']['cpus']} CPUs",
             "", f"{args.rows} photo-like 256×256 JPEG (q90, {result['ceilings']['jpeg_kb']:.1f} KB) + lz4 masks; one whole shuffled epoch each, open to last sample.",
             "", "| asyncload | samples/s, epoch 1 | CPU ms/sample | first batch s | samples/s, epoch 2 | CPU ms/sample, epoch 2 |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in result["runs"]:
        if "error" in r:
            lines.append(f"| {r['reader']} | {r['error']} | | |")
        else:
            lines.append(
                f"| {r['reader']} | {r['samples_per_s']:,.0f} | {r['cpu_ms_per_sample']:.3f} | {r['first_batch_s']:.2f} "
                f"| {r['epoch2_samples_per_s']:,.0f} | {r['epoch2_cpu_ms_per_sample']:.3f} |"
            )
    c = result["ceilings"]
    lines += ["", "Ceilings in the same run: " + ", ".join(f"{k} {v:,.0f}" for k, v in c.items() if k != "jpeg_kb")]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
