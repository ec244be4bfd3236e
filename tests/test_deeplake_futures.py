"""Deep Lake's ``Future.__await__`` is never called: its completion is polled (``runtime.polled``).

Deep Lake 4.7.4's ``__await__`` races with its own completion thread and segfaults when a garbage
collection runs a finaliser inside it (benchmarks/results/isolation/deeplake_await_crash.md). These tests
read in fresh interpreters under that stress, and run the loader's paths with ``__await__`` replaced by a
tripwire, in the training process, in a reader process and in a DataLoader worker.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from asyncload.runtime.polled import completion

from .conftest import ROWS

REPO = Path(__file__).resolve().parents[1]

#: Fresh interpreters of the stress, two at a time. With Deep Lake's ``await`` in ``DeepLakeSource.read``
#: the same stress crashed 8 of 8 interpreters of its read phase here (each within 2-3 s); with polling,
#: 0 of 200 (``deeplake_await_crash.md``).
RUNS = 4


def _stress(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tests.gc_pressure_child", url, "400", "40"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=100,
    )


@pytest.mark.timeout(240)
def test_reads_in_process_under_collector_pressure_never_crash(seg_url) -> None:
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(_stress, [seg_url] * RUNS))
    for run in runs:
        assert run.returncode == 0, f"a stress interpreter ended with {run.returncode}:\n{run.stderr[-3000:]}"
        # 400 single-row reads, then 40 epochs of two batches of 4 rows each
        assert run.stdout.split() == ["400", "320"]


#: A ``sitecustomize`` for the child processes of a test: ``Future.__await__`` replaced by a tripwire that
#: records the call (in a file: a reader process's output is not the test's) and raises.
_TRIPWIRE = """
import os, deeplake
def _tripped(self):
    with open(os.environ["ASYNCLOAD_TEST_AWAIT_TRIPWIRE"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    raise AssertionError("deeplake.Future.__await__ was called")
deeplake.Future.__await__ = _tripped
"""

_EPOCHS = r"""
import sys, torch
from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource
url = sys.argv[1]
counts = []
for processes in (0, 1):
    rows = []
    with AsyncLoader(DeepLakeSource(url), batch_size=8, processes=processes, with_index=True, shuffle=True) as ld:
        for batch in ld:
            rows += batch["index"].tolist()
    counts.append(sorted(rows) == list(range(len(DeepLakeSource(url)))))
ds = AsyncIterableDataset(DeepLakeSource(url), 8, with_index=True)
dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn", timeout=60)
rows = [i for batch in dl for i in batch["index"].tolist()]
counts.append(sorted(rows) == list(range(len(DeepLakeSource(url)))))
print(counts)
"""


@pytest.mark.timeout(180)
def test_no_path_of_the_loader_calls_deep_lakes_await(seg_url, tmp_path) -> None:
    """In the training process (``processes=0``), in a reader process and in DataLoader workers, an epoch is
    exact and ``Future.__await__`` is never called."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_TRIPWIRE)
    trip = tmp_path / "awaited"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
        "ASYNCLOAD_TEST_AWAIT_TRIPWIRE": str(trip),
    }
    run = subprocess.run(
        [sys.executable, "-c", _EPOCHS, seg_url], env=env, capture_output=True, text=True, timeout=170, cwd=REPO
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert not trip.exists(), f"Future.__await__ was called in processes {trip.read_text().split()}"
    assert run.stdout.split("\n")[-2] == "[True, True, True]"


def test_the_tripwire_would_see_an_await(seg_url, tmp_path) -> None:
    """The tripwire of the test above does catch a plain ``await`` of a Deep Lake future."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_TRIPWIRE)
    trip = tmp_path / "awaited"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "ASYNCLOAD_TEST_AWAIT_TRIPWIRE": str(trip)}
    code = "import asyncio, deeplake, sys\nds = deeplake.open_read_only(sys.argv[1])\n"
    code += "async def main():\n    await ds['images'].get_async([0])\nasyncio.run(main())\n"
    run = subprocess.run([sys.executable, "-c", code, seg_url], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "deeplake.Future.__await__ was called" in run.stderr
    assert len(trip.read_text().split()) == 1


_READ_CALLS = {"get_async", "get_bytes_async"}


def _module_call(func: ast.Attribute) -> bool:
    """``obstore.get_async(...)``: another library's function of the same name, not a Deep Lake read."""
    return isinstance(func.value, ast.Name) and func.value.id == "obstore"


def _unpolled_reads(path: Path) -> list[int]:
    """Lines of ``path`` where a Deep Lake read's future is passed anywhere but to ``completion(s)``: awaited,
    gathered, or wrapped. A read assigned to a name or returned is followed no further (``DeepLakeSource``,
    which does that, is run with the tripwire above)."""
    tree = ast.parse(path.read_text())
    bad = []
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            call = child.value if isinstance(child, ast.Starred) else child
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Attribute):
                continue
            if call.func.attr not in _READ_CALLS or _module_call(call.func):
                continue
            if isinstance(node, ast.Await):
                bad.append(call.lineno)
            elif isinstance(node, ast.Call) and not (
                isinstance(node.func, ast.Name) and node.func.id in ("completion", "completions")
            ):
                bad.append(call.lineno)
    return sorted(bad)


def test_the_benchmarks_peers_and_probes_poll_deep_lake_futures_too(tmp_path) -> None:
    """The readers in ``benchmarks/`` that stand beside asyncload wait on Deep Lake as it does."""
    found = {}
    for path in sorted([*REPO.glob("benchmarks/**/*.py"), *REPO.glob("asyncload/**/*.py")]):
        if lines := _unpolled_reads(path):
            found[str(path.relative_to(REPO))] = lines
    assert not found, f"Deep Lake futures awaited or gathered directly: {found}"
    sample = "async def f(c):\n    await asyncio.gather(c.get_async([0]))\n    await c.get_bytes_async([1])\n"
    probe = tmp_path / "probe.py"
    probe.write_text(sample)
    assert _unpolled_reads(probe) == [2, 3]  # the check itself sees both shapes


async def test_completion_gives_each_future_its_own_result_in_any_order(seg_url, seg_arrays) -> None:
    """Futures waited for in the reverse of their issue order each get their own rows (no failing read
    here: those belong in a reader process, ``conftest``)."""
    import deeplake
    import numpy as np

    ds = deeplake.open_read_only(seg_url)
    futs = [ds["masks"].get_async([i, ROWS - 1 - i]) for i in range(8)]
    for i, fut in reversed(list(enumerate(futs))):
        got = await completion(fut)
        np.testing.assert_array_equal(np.stack(got), seg_arrays["masks"][[i, ROWS - 1 - i]])
