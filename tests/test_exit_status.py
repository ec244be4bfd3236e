"""A training script that ends while a loader reads Deep Lake in its own process (``processes=0``) exits with
its own status: open mid-epoch, an epoch left to the collector, an uncaught error, DataLoader workers that
end with the epoch. Each in fresh interpreters (Deep Lake's threads are still running at exit, which once
crashed 7 of 10 such exits: ``benchmarks/results/isolation/deeplake_await_crash.md``). Ctrl-C is
``test_shutdown``'s."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXPECTED = {"open": 3, "abandoned": 4, "raises": 1, "dataloader": 5}
RUNS = 1  # of each here; 20 of each, measured, gave their own status every time (deeplake_await_crash.md)


@pytest.mark.timeout(300)
def test_a_script_ending_with_a_loader_mid_epoch_exits_with_its_own_status(seg_url) -> None:
    def run(scenario: str) -> tuple[str, int, str]:
        done = subprocess.run(
            [sys.executable, "-m", "tests.exit_child", seg_url, scenario],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        return scenario, done.returncode, done.stderr

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, [s for s in EXPECTED for _ in range(RUNS)]))
    for scenario, code, err in results:
        assert code == EXPECTED[scenario], f"{scenario}: exit status {code}\n{err[-3000:]}"
        for bad in ("Fatal Python error", "Segmentation fault", "Aborted", "Event loop is closed"):
            assert bad not in err, f"{scenario}: {bad}\n{err[-3000:]}"
    raised = [err for scenario, _, err in results if scenario == "raises"]
    assert all(err.rstrip().endswith("RuntimeError: the training step failed") for err in raised)
