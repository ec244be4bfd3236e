"""Where the test suite's CPU goes: a pytest plugin that charges each test the CPU of its process and of the
child processes it waited for, and a summary of a run.

Why: ``make test`` has an 8-minute budget on 2 cores, and most of the suite's CPU is spent in child processes
(interpreters, readers, DataLoader workers, pip), which ``--durations`` does not show: a test that waits on
a stalled store for 10 s costs no CPU, and one that installs a wheelhouse costs a minute of it. Summed, a
run's CPU divided by the cores is the least time the suite can take.

    ASYNCLOAD_TEST_CPU=/tmp/cpu bash harness/run_suite.sh .venv/bin/python -p harness.suite_cpu
    python -m harness.suite_cpu /tmp/cpu        # the total, by file and the 25 dearest tests

Each pytest process (each xdist worker) writes ``<dir>/<worker>.json``: ``[test id, own CPU s, children's
CPU s, wall s]`` per test. A child's CPU is counted when it is reaped (``RUSAGE_CHILDREN``), so a process that
outlives its test (a node's shared reader) is charged to the test that reaps it, or to none.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_rows: list[tuple[str, float, float, float]] = []


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    own, kids = _cpu()
    t = time.monotonic()
    yield
    own2, kids2 = _cpu()
    _rows.append((item.nodeid, round(own2 - own, 3), round(kids2 - kids, 3), round(time.monotonic() - t, 3)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    where = os.environ.get("ASYNCLOAD_TEST_CPU")
    if not where or not _rows:
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    name = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (Path(where) / f"{name}.json").write_text(json.dumps(_rows))


def summary(where: Path, top: int = 25) -> str:
    rows: list[Any] = [r for f in sorted(where.glob("*.json")) for r in json.loads(f.read_text())]
    total = sum(own + kids for _, own, kids, _ in rows)
    files: dict[str, float] = defaultdict(float)
    for test, own, kids, _ in rows:
        files[test.split("::")[0]] += own + kids
    lines = [
        f"{len(rows)} tests, {total:,.0f} CPU s ({total / 2 / 60:.1f} min on 2 cores at the least)",
        "",
        "by file:",
    ]
    lines += [f"  {s:7.1f}  {f}" for f, s in sorted(files.items(), key=lambda kv: -kv[1])[:top]]
    lines += ["", "by test (own + children's CPU s, wall s):"]
    for test, own, kids, wall in sorted(rows, key=lambda r: -(r[1] + r[2]))[:top]:
        lines.append(f"  {own + kids:7.1f}  {wall:6.1f}  {test}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1])))
