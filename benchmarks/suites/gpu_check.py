"""``make gpu-check``: the one prepared GPU run, for the minutes a GPU node is at hand (issue 52).

    python benchmarks/suites/gpu_check.py [--rows 16000] [--quick] [--out benchmarks/results/gpu_check]

Runs from a checkout and the offline wheelhouse (``make wheelhouse``, docs/guides/air-gapped-gpu.md) on a
node with no network, needing nothing the wheelhouse does not bring: its dataset is drawn with numpy and
Pillow (``testbeds/photos.py``'s ``drawn_sample``, not scikit-image's photographs), its tests run with
plain pytest and pytest-timeout (the ``check`` extra; no pytest-xdist). It writes one folder,
``<out>/<host>-<date>/`` (``results.json``, ``summary.md``) naming the machine: the folder to send back.
In order, each part timed, the whole under 8 minutes on one H200 with 16 cores:

1. the CUDA tests (``tests/test_gpu_decode.py``, ``tests/test_device.py``, ``tests/test_normalize.py``);
2. JPEG + lz4 pairs per second into GPU memory, normalized NCHW bf16 through ``DeviceFeed``, with
   ``decode="cuda"`` (nvJPEG) against CPU decode, one process against ``processes=4``, and the CPU
   milliseconds per pair of the whole process tree (``gpu_decode.one_epoch``: a whole shuffled epoch,
   then a second one reported apart);
3. the U-Net's step rate fed by the loader against the model alone on batches already on the GPU
   (``unet``: ``gpu_feed.training``'s run).

A part that fails does not stop the others: its error and the tail of its output are kept in
``results.json`` and in the summary, so that a run on a borrowed machine says why without a second run.
The exit status is 0 only when every part ran.

Targets (issue 52): >= 20,000 pairs/s into GPU memory, <= 0.3 ms CPU per pair, ``processes=4`` >= 1.0x
one process, the U-Net with the loader >= 0.95x the model alone. Without CUDA the same script runs the
CPU parts at a small size, skips the GPU ones (the CUDA tests skip themselves, ``decode="cuda"`` runs as
``"cpu"`` without a copy) and says so in its summary.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from asyncload.tools.train import TrainConfig, train  # noqa: E402
from benchmarks.suites.gpu_decode import one_epoch  # noqa: E402
from benchmarks.suites.gpu_feed import machine  # noqa: E402

READY = {"normalize": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), "layout": "NCHW", "dtype": torch.bfloat16}
CUDA_TESTS = ("tests/test_gpu_decode.py", "tests/test_device.py", "tests/test_normalize.py")
TAIL_LINES = 25  # of a failed part's output: enough for a traceback's last frames and its error


def tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def part(name: str, fn: Callable[[], Any], parts: dict[str, Any]) -> Any:
    """``fn()``'s value under ``parts[name]``, timed; where it raises, the error and its traceback's tail
    instead (and None returned), so that one failure leaves the other parts' figures and its own reason."""
    t0 = time.perf_counter()
    try:
        value = fn()
    except Exception as e:  # noqa: BLE001 (any failure is a result to report, not a reason to stop)
        parts[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "tail": tail(traceback.format_exc())}
        value = None
    else:
        parts[name] = {"ok": True, "value": value}
    parts[name]["s"] = time.perf_counter() - t0
    return value


def cuda_tests() -> dict[str, Any]:
    """The CUDA tests in one pytest process (no ``-n``: pytest-xdist is not in the wheelhouse); a failing
    run raises with its output's tail, pytest's own reason included (a missing plugin, a collection error)."""
    got = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CUDA_TESTS],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    said = [line for line in got.stdout.splitlines() if " passed" in line or " failed" in line or " skipped" in line]
    summary = said[-1].strip("= ") if said else "no summary line"
    if got.returncode:
        raise RuntimeError(f"pytest exited {got.returncode}: {summary}\n{tail(got.stdout + got.stderr)}")
    return {"summary": summary}


def _drawn_rows(span: tuple[int, int]) -> list[tuple[bytes, np.ndarray]]:
    """Rows ``[start, start + n)``: JPEG q90 bytes and the mask (a pool worker's task)."""
    from benchmarks.testbeds.photos import drawn_sample, encode

    start, n = span
    out = []
    for i in range(start, start + n):
        img, mask = drawn_sample(np.random.default_rng([0, i]), 256)
        out.append((encode(img, "jpg"), mask))
    return out


def make_data(path: str, rows: int) -> dict[str, Any]:
    """``rows`` photo-like 256x256 JPEG q90 + lz4 mask pairs at ``path`` (made once and kept: a dataset
    there is reused), and the mean stored bytes of a pair, by which later runs compare."""
    import deeplake

    url = "file://" + path
    if not os.path.exists(path):
        spans = [(s, min(500, rows - s)) for s in range(0, rows, 500)]
        if len(spans) > 1:
            import multiprocessing as mp

            with mp.get_context("spawn").Pool(min(len(spans), max(1, (os.cpu_count() or 2) - 1))) as pool:
                parts = pool.map(_drawn_rows, spans)
        else:
            parts = [_drawn_rows(s) for s in spans]
        part_path = path + ".part"  # renamed when whole: an interrupted run leaves nothing to reuse
        shutil.rmtree(part_path, ignore_errors=True)  # (an interrupted run's)
        ds = deeplake.create("file://" + part_path)
        ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="jpg"))
        ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", sample_compression="lz4"))
        for p in parts:
            ds.append({"images": [r[0] for r in p], "masks": np.stack([r[1] for r in p])})
        ds.commit(f"{rows} rows of benchmarks/testbeds/photos.py drawn_sample, 256x256 JPEG q90 + lz4")
        del ds
        os.rename(part_path, path)
    ds = deeplake.open_read_only(url)
    probe = list(range(min(64, len(ds))))
    pair = np.mean([len(ds[i].get_bytes("images")) + len(ds[i].get_bytes("masks")) for i in probe])
    return {"url": url, "rows": len(ds), "bytes_per_pair": float(pair)}


def unet(url: str, gpu: bool, epochs: int, model_only_steps: int) -> list[dict[str, Any]]:
    """The U-Net (width 32, batches of 32) fed by the loader, nvJPEG decoding and normalized NCHW bf16
    delivered (``decode="cuda", model_ready=True``), then ``model_only_steps`` of the model alone on a
    batch already on the device: ``gpu_feed.training``'s run, its model-only steps a setting so that the
    quick run on a CPU (where both are the CPU's) takes seconds, not minutes."""
    cfg = TrainConfig(
        data=url, make_data=False, rows=0, width=32, batch_size=32, epochs=epochs, concurrency=256,
        device="cuda" if gpu else "cpu", checkpoint=None, progress=False, model_only_steps=model_only_steps,
        bf16=gpu, channels_last=gpu, decode="cuda" if gpu else "cpu", model_ready=True,
    )  # fmt: skip
    return train(cfg)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=None, help="rows of the dataset (16,000 on a GPU, 1,000 without)")
    ap.add_argument("--quick", action="store_true", help="a dry run: 256 rows, one training epoch, 4 model-only steps")
    ap.add_argument("--data", default="/tmp/asyncload-gpu-check", help="where the dataset is made (kept)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    a = ap.parse_args(argv)
    gpu = torch.cuda.is_available()
    rows = a.rows or (256 if a.quick else 16000 if gpu else 1000)
    where = a.out / f"{socket.gethostname()}-{datetime.date.today().isoformat()}"
    where.mkdir(parents=True, exist_ok=True)
    parts: dict[str, Any] = {}
    res: dict[str, Any] = {"machine": machine(), "cuda": gpu, "rows": rows, "parts": parts}
    said = [] if gpu else ["no CUDA device: the GPU parts are skipped (the CUDA tests skip, decode='cuda' runs as 'cpu', no copy)"]  # fmt: skip
    t0 = time.perf_counter()
    part("cuda_tests", cuda_tests, parts)
    data = part("data", lambda: make_data(f"{a.data}-drawn-{rows}", rows), parts)
    runs = [
        ("CPU decode, one process", {"decode": "cpu", **READY}),
        ("decode=cuda, one process", {"decode": "cuda", **READY}),
        ("decode=cuda, processes=4", {"decode": "cuda", "processes": 4, **READY}),
    ]
    epochs = 1 if a.quick or not gpu else 2
    if data is not None:
        for name, opts in runs:
            part(f"pairs: {name}", lambda name=name, opts=opts: one_epoch(name, data["url"], feed=True, **opts), parts)
        part("unet", lambda: unet(data["url"], gpu, epochs, 40 if gpu and not a.quick else 4), parts)
    res["seconds"] = time.perf_counter() - t0
    (where / "results.json").write_text(json.dumps(res, indent=1, default=str))
    text = summary(res, said)
    (where / "summary.md").write_text(text)
    print(text)
    failed = [name for name, p in parts.items() if not p["ok"]]
    print(f"results: {where}" + (f" (failed: {', '.join(failed)})" if failed else " (every part ran)"))
    return 1 if failed or data is None else 0


def summary(res: dict[str, Any], said: list[str]) -> str:
    """The run as Markdown: what was skipped, every part that failed with its reason, then the figures."""
    m, parts = res["machine"], res["parts"]
    lines = [f"# gpu-check on {m['gpu']} ({m['cpus']} CPUs, Python {m['python']}, torch {m['torch']})", ""]
    lines += [f"- {s}" for s in said]
    tests = parts["cuda_tests"]
    lines.append(f"- CUDA tests: {tests['value']['summary'] if tests['ok'] else 'FAILED'} ({tests['s']:.0f} s)")
    if data := parts.get("data", {}).get("value"):
        lines.append(
            f"- {data['rows']:,} rows of photo-like 256x256 JPEG q90 + lz4 masks (drawn: testbeds/photos.py "
            f"drawn_sample), {data['bytes_per_pair'] / 1e3:.1f} KB a pair, local disk"
        )
    lines.append(f"- whole run {res['seconds']:.0f} s")
    for name, p in parts.items():
        if not p["ok"]:
            lines += ["", f"## {name}: FAILED after {p['s']:.0f} s", "", p["error"].splitlines()[0], "", "```", p["tail"], "```"]  # fmt: skip
    pairs = {n.removeprefix("pairs: "): p["value"] for n, p in parts.items() if n.startswith("pairs: ") and p["ok"]}
    if pairs:
        lines += [
            "",
            "| pairs into memory (NCHW bf16, normalized) | epoch 1 pairs/s | epoch 2 pairs/s | CPU ms/pair | first batch s |",
            "|---|---|---|---|---|",
        ]
        for name, r in pairs.items():
            label = name if res["cuda"] or "cuda" not in name else f"{name} (no CUDA: ran as decode='cpu')"
            lines.append(
                f"| {label} | {r['samples_per_s']:,.0f} | {r.get('epoch2_samples_per_s', 0):,.0f} | "
                f"{r['cpu_ms_per_sample']:.3f} | {r['first_batch_s'] or 0:.2f} |"
            )
    one, four = pairs.get("decode=cuda, one process"), pairs.get("decode=cuda, processes=4")
    if one and four:
        ratio = f"processes=4 against one process: {four['samples_per_s'] / one['samples_per_s']:.2f}x"
        lines += ["", ratio + ("" if res["cuda"] else " (no CUDA: both decoding on the CPU)")]
    for e in (parts.get("unet", {}).get("value") or []) if parts.get("unet", {}).get("ok") else []:
        if isinstance(e, dict) and e.get("samples_per_s") and e.get("model_only_samples_per_s"):
            lines.append(
                f"U-Net epoch {e.get('epoch')}: {e['samples_per_s']:,.0f} samples/s with the loader, "
                f"{e['model_only_samples_per_s']:,.0f} the model alone ({e['samples_per_s'] / e['model_only_samples_per_s']:.2f}x)"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
