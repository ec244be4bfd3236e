"""``make test``'s runner (``harness/run_suite.sh`` + ``harness/crash_report.py``), run on small suites of its
own in a scratch checkout: one pass, no re-run; cores never left behind; a worker's native crash fails the run
and names its test; a child process a test crashes on purpose is not reported as a crash."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from harness.crash_report import WORKER_CRASH, find_cores, is_core

REPO = Path(__file__).resolve().parents[1]

#: Cores land in the crashing process's working directory only with a plain ``core_pattern``; a pipe
#: (systemd-coredump, apport) or an absolute path sends them elsewhere, and these tests have nothing to find.
PATTERN = (
    Path("/proc/sys/kernel/core_pattern").read_text().strip() if Path("/proc/sys/kernel/core_pattern").exists() else ""
)
needs_local_cores = pytest.mark.skipif(
    PATTERN.startswith("|") or PATTERN.startswith("/") or resource.getrlimit(resource.RLIMIT_CORE)[1] == 0,
    reason=f"core_pattern {PATTERN!r} does not write cores into the working directory, or the hard core limit is 0",
)

CHILD_CRASH = """
import os, subprocess, sys
def test_a_child_crashes_on_purpose():
    code = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    assert subprocess.run([sys.executable, "-c", code], cwd=os.getcwd()).returncode == -11
def test_another_passes():
    pass
"""

WORKER_CRASH_SUITE = """
import ctypes
def test_fine():
    pass
def test_this_one_dies_natively():
    ctypes.string_at(0)  # a real segfault in the worker itself
"""


def run_suite(tmp_path: Path, suite: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "test_suite.py").write_text(suite)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        ["bash", str(REPO / "harness" / "run_suite.sh"), sys.executable, "-p", "no:cacheprovider", "test_suite.py"],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    return run, checkout


def no_core_under(path: Path) -> list[str]:
    return [str(p) for p in path.rglob("core*") if is_core(p)]


@needs_local_cores
@pytest.mark.timeout(300)
def test_a_core_of_a_child_a_test_crashes_is_taken_away_and_the_run_passes(tmp_path) -> None:
    run, checkout = run_suite(tmp_path, CHILD_CRASH)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "2 passed" in run.stdout
    assert "1 core file(s) from the tests' child processes" in run.stdout
    assert "native crash" not in run.stdout and "Thread 1" not in run.stdout
    assert no_core_under(tmp_path) == []  # not in the checkout, nor in the run's temporary directory
    assert not list(tmp_path.glob("asyncload-cores.*"))


@needs_local_cores
@pytest.mark.timeout(300)
def test_a_worker_killed_by_a_native_crash_fails_the_run_once_naming_its_test(tmp_path) -> None:
    run, checkout = run_suite(tmp_path, WORKER_CRASH_SUITE)
    out = run.stdout
    assert run.returncode != 0
    assert out.count("test session starts") == 1  # one pass, never run again
    assert "=== a native crash killed pytest worker gw" in out
    assert "while it ran test_suite.py::test_this_one_dies_natively ===" in out
    if subprocess.run(["which", "gdb"], capture_output=True).returncode == 0:
        assert "the faulting thread, again" in out and "#0 " in out
    assert no_core_under(tmp_path) == []
    assert not list(tmp_path.glob("asyncload-cores.*"))


def test_cores_are_told_apart_from_files_named_core(tmp_path) -> None:
    (tmp_path / "core").write_bytes(b"\x7fELF" + b"\0" * 12 + (4).to_bytes(2, "little"))
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "core").write_text("a module named core, not a core dump")
    (tmp_path / "pkg" / "core.12").write_bytes(b"\x7fELF" + b"\0" * 12 + (2).to_bytes(2, "little"))  # ET_EXEC
    assert find_cores([tmp_path], since=0.0) == [tmp_path / "core"]
    assert find_cores([tmp_path], since=(tmp_path / "core").stat().st_mtime + 1) == []


def test_the_worker_and_its_test_are_read_off_xdists_line() -> None:
    line = "[gw2] node down: Not properly terminated\nworker 'gw2' crashed while running 'tests/test_x.py::test_y[a]'"
    assert WORKER_CRASH.findall(line) == [("gw2", "tests/test_x.py::test_y[a]")]
