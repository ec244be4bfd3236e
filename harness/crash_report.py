"""After the test suite: print the backtrace of every thread in the core a native crash left.

A native crash (Deep Lake's failing-read bug, or anything else) kills its process without a Python
traceback: Deep Lake's import replaces the SIGSEGV handler that faulthandler would use. Under xdist the
process is a worker and pytest itself exits 1 ("worker 'gw2' crashed while running ..."), so a core is
looked for whatever the exit status. ``make test`` runs pytest with ``ulimit -c unlimited``; this takes the
newest core in the working directory written since the run started and asks gdb for ``thread apply all
bt`` and the faulting thread's Python stack (``py-bt``, where CPython's gdb helpers are installed), so that
a CI log names the faulting thread and the test. Crashes the suite causes on purpose dump no core
(``tests/sources.py``), but a reader process that Deep Lake's failing-read bug kills may (the fault and
stall tests make reads fail through it, and the loader replaces it): after a passing run a core is only
mentioned. Usage: ``python -m harness.crash_report <exit status> <python> [<run start, epoch s>]``.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys


def main(status: int, python: str, since: float = 0.0) -> None:
    cores = sorted((c for c in glob.glob("core*") if os.path.getmtime(c) >= since), key=os.path.getmtime)
    if status > 128:
        try:
            name = signal.Signals(status - 128).name
        except ValueError:
            name = str(status - 128)
        print(f"\n=== the test run died by signal {name} (exit status {status}) ===", flush=True)
    elif cores and status != 0:
        print(f"\n=== a process of the test run dumped core (exit status {status}) ===", flush=True)
    else:
        if cores:  # a reader process the suite's failing reads killed (Deep Lake's bug), as designed
            print(f"({len(cores)} core file(s) from this run's child processes, the tests passed: newest {cores[-1]})")
        return
    if not cores:
        print(f"no core file here (core_pattern: {_read('/proc/sys/kernel/core_pattern')!r}, ulimit -c may be 0)")
        return
    core = cores[-1]
    if shutil.which("gdb") is None:
        print(f"core file {core} kept; gdb is not installed, so no backtrace")
        return
    files = [os.path.realpath(python), core]
    # The faulting thread is the one gdb selects first ("Program terminated with signal ..."). `thread apply
    # all bt` prints it last, and a CI log keeps only the head and the tail of a long report, so its native
    # and Python stacks are printed on their own, first and again at the very end.
    faulting = _gdb(files, "bt 40", "py-bt")
    print(faulting)
    print(_gdb(files, "info threads", "thread apply all bt 12")[:40_000])
    print("=== the faulting thread, again ===")
    print(faulting[-8_000:])
    print(f"=== core file: {core} ===")


def known_deeplake_await_crash(log: str) -> bool:
    """Whether the run's output shows a worker killed by Deep Lake 4.7.4's crash inside its own
    ``Future.__await__`` (``benchmarks/results/isolation/deeplake_await_crash.md``): faulthandler's report
    of a segmentation fault whose current thread's top frame is the ``await`` in ``DeepLakeSource.read``.
    It strikes a test that reads Deep Lake in the pytest process (``processes=0``) now and then, whatever
    the test; nothing in asyncload's code is on its stack."""
    at = log.find("Fatal Python error: Segmentation fault")
    if at < 0:
        return False
    # faulthandler lists the other threads too, before or after the one that faulted ("Current thread")
    cur = log.find("Current thread ", at)
    current = log[cur:].split("\n\n", 1)[0] if cur >= 0 else ""
    frames = [line.strip() for line in current.splitlines() if line.strip().startswith("File ")]
    return bool(frames) and "asyncload/sources/deeplake.py" in frames[0] and frames[0].endswith(" in read")


def _gdb(files: list[str], *commands: str) -> str:
    """gdb's answers to ``commands`` on the core (``files``: the executable and the core)."""
    args = ["gdb", "-batch", "-nx", "-iex", "set auto-load safe-path /"]
    args += [a for c in commands for a in ("-ex", c)]
    return subprocess.run(args + files, capture_output=True, text=True, timeout=300).stdout


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


if __name__ == "__main__":
    if sys.argv[1] == "--known":  # exit 0 where the log at argv[2] shows the known Deep Lake await crash
        with open(sys.argv[2], errors="replace") as f:
            sys.exit(0 if known_deeplake_await_crash(f.read()) else 1)
    main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
