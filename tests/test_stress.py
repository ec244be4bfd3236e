"""The healthy path under the defaults, many times over (``make test-slow``): fresh processes each read
whole shuffled epochs of photo-like JPEG + lz4 datasets, locally and on SeaweedFS, and none may crash.

Deep Lake's failing-read segfault never reaches a read that succeeds; this is the check that the default
path (a reader process, stored bytes decoded by asyncload) has no crash of its own: every process exits 0,
reads every row once per epoch, and no reader was ever replaced.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from asyncload import make_dataset

ROOT = Path(__file__).resolve().parents[1]
ROWS = 600
RUNS = 12

READ = r"""
import json, sys
from asyncload import AsyncLoader, DeepLakeSource
url, creds = sys.argv[1], json.loads(sys.argv[2])
loader = AsyncLoader(DeepLakeSource(url, creds=creds or None), batch_size=32, shuffle=True, seed=int(sys.argv[3]))
epochs = []
for epoch in range(2):
    loader.set_epoch(epoch)
    epochs.append(sorted(int(i) for b in loader for i in b["index"]))
print(json.dumps({"epochs": epochs, "restarts": loader.stats()["worker_restarts"], "processes": loader.processes}))
"""


def _runs(url: str, creds: dict[str, str] | None) -> None:
    for run in range(RUNS):
        p = subprocess.run(
            [sys.executable, "-c", READ, url, json.dumps(creds or {}), str(run)],
            capture_output=True, text=True, timeout=240, cwd=ROOT,
        )  # fmt: skip
        assert p.returncode == 0, f"run {run}: rc={p.returncode}\n{p.stderr[-3000:]}"
        got = json.loads(p.stdout.strip().splitlines()[-1])
        assert got["processes"] == 1 and got["restarts"] == 0, got
        assert got["epochs"] == [list(range(ROWS))] * 2


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fresh_processes_read_whole_photo_epochs_locally_with_no_crash(tmp_path: Path) -> None:
    url = make_dataset(
        str(tmp_path / "photos"), ROWS, image_format="jpg", sizes=(256, 256), aspect=(1, 1), progress=False
    )
    _runs(url, None)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_fresh_processes_read_whole_photo_epochs_on_seaweedfs_with_no_crash(seaweed) -> None:
    seaweed.create_bucket("stress")
    creds = seaweed.creds("stress")
    url = make_dataset(
        "s3://stress/photos", ROWS, image_format="jpg", sizes=(256, 256), aspect=(1, 1), creds=creds, progress=False
    )
    _runs(url, creds)
