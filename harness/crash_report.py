"""After the test suite died by a signal: print the backtrace of every thread in its core file.

A native crash (Deep Lake's failing-read bug, or anything else) kills pytest without a Python traceback:
Deep Lake's import replaces the SIGSEGV handler that faulthandler would use. ``make test`` runs pytest with
``ulimit -c unlimited``; this finds the newest core in the working directory and asks gdb for
``thread apply all bt``, so that a CI log names the faulting thread instead of only "Segmentation fault".
Usage: ``python -m harness.crash_report <exit status> <python executable>``.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys


def main(status: int, python: str) -> None:
    sig = status - 128
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = str(sig)
    print(f"\n=== the test run died by signal {name} (exit status {status}) ===", flush=True)
    cores = sorted(glob.glob("core*"), key=os.path.getmtime)
    if not cores:
        print(f"no core file here (core_pattern: {_read('/proc/sys/kernel/core_pattern')!r}, ulimit -c may be 0)")
        return
    core = cores[-1]
    if shutil.which("gdb") is None:
        print(f"core file {core} kept; gdb is not installed, so no backtrace")
        return
    out = subprocess.run(
        ["gdb", "-batch", "-nx", "-ex", "info threads", "-ex", "thread apply all bt 25", os.path.realpath(python), core],
        capture_output=True, text=True, timeout=300,
    ).stdout  # fmt: skip
    # The faulting thread is the one gdb selects first ("Program terminated with signal ...").
    print(out[-60_000:])
    print(f"=== core file: {core} ===")


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
