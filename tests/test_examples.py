"""The scripts under ``examples/`` run as their docstrings say. ``train_ddp.py``, the complete torchrun +
DDP script the training-loops guide shows, runs in its CPU form: 2 ranks over gloo under a real
``torchrun`` on a real Deep Lake dataset, stopped mid-epoch by ``--max-steps`` and run again, which must
resume exactly: the two runs' first epoch covers the dataset's 96 rows once."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncload import make_dataset

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses_and_says_how_to_run_it(script: Path) -> None:
    tree = ast.parse(script.read_text(), filename=str(script))
    doc = ast.get_docstring(tree) or ""
    assert f"examples/{script.name}" in doc, f"{script.name}: its docstring does not show how to run it"


def torchrun(cwd: Path, *args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "examples" / "train_ddp.py"), "--data", "data/seg", "--crop", "32", "--batch-size", "8",
         "--epochs", "2", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [ln for ln in done.stdout.splitlines() if ln.startswith(("epoch", "resumed"))]


@pytest.mark.timeout(240)
def test_train_ddp_runs_on_two_gloo_ranks_and_resumes_mid_epoch_exactly(tmp_path: Path) -> None:
    make_dataset(str(tmp_path / "data" / "seg"), 96, height=48, width=64, progress=False)
    first = torchrun(tmp_path, "--max-steps", "3")  # 3 steps × 2 ranks × 8 = 48 of epoch 0's 96 rows
    assert len(first) == 1 and first[0].startswith("epoch 0: 48 samples,"), first
    assert first[0].endswith("; stopped after 3 steps") and "on 2 ranks" in first[0]
    assert (tmp_path / "checkpoint.pt").exists()
    second = torchrun(tmp_path)
    assert second[0] == "resumed in epoch 0 from checkpoint.pt", second
    assert second[1].startswith("epoch 0: 48 samples,"), second  # exactly the rest of epoch 0
    assert second[2].startswith("epoch 1: 96 samples,") and len(second) == 3, second
