"""Long run (``make test-slow``): 100,000 samples per concurrency setting over 50 epochs of a small local
dataset, with no leak of memory, threads, descriptors, processes or shared memory.

It runs ``benchmarks/suites/long_run.py`` in a process of its own, so that RSS and the thread, descriptor and
child counts are the loader's and nothing else's (pytest's own state, other tests' servers), and asserts
the script's verdicts: RSS growth from the end of the second epoch to the end below 50 MB; Python
threads, descriptors, child processes and ``/dev/shm`` files held no higher at the last epoch end than
at the second; OS threads (Deep Lake's native pool included) with no upward trend. The figures are
printed (``-s``) for the record.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
INTERVAL = 0.25  # seconds between the script's looks mid-epoch: a run of 100,000 small samples lasts seconds


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_100k_samples_per_setting_without_leaks(tmp_path: Path) -> None:
    out = tmp_path / "long_run.json"
    p = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "suites" / "long_run.py"), "--rows", "2000", "--size", "32",
         "--batch-size", "64", "--samples", "100000", "--concurrency", "auto,256", "--interval", str(INTERVAL),
         "--rss-bound-mb", "50", "--json", str(out)],
        capture_output=True, text=True, timeout=850, cwd=ROOT,
    )  # fmt: skip
    print(p.stdout)
    assert out.exists(), f"rc={p.returncode}\n{p.stdout}\n{p.stderr[-4000:]}"
    report = json.loads(out.read_text())
    verdicts = report["verdicts"]
    assert [v["concurrency"] for v in verdicts] == ["auto", "256"]
    for v in verdicts:
        assert v["samples"] >= 100_000 and v["epochs"] >= 50, v
        failed = [k for k, ok in v["checks"].items() if not ok]
        assert not failed, f"concurrency {v['concurrency']}: {failed}: {json.dumps(v, indent=1)}"
        # Looked at all along: at least half the looks the run's length allows (the sampler shares the CPU).
        assert len(report["runs"][verdicts.index(v)]["periodic"]) >= max(3, int(v["seconds"] / INTERVAL) // 2), v
    assert p.returncode == 0, p.stderr[-4000:]
