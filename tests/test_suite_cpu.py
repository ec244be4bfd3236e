"""``harness/suite_cpu.py``: each test is charged its own CPU and the CPU of the child processes it waited
for, and the summary ranks them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.suite_cpu import summary

ROOT = Path(__file__).resolve().parents[1]

TESTS = """
import subprocess, sys, time

def test_child_burns():
    subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass"], check=True)

def test_sleeps():
    time.sleep(0.3)
"""


@pytest.mark.timeout(120)
def test_a_run_charges_each_test_its_childrens_cpu_and_the_summary_ranks_them(tmp_path: Path) -> None:
    (tmp_path / "test_tiny.py").write_text(TESTS)
    out = tmp_path / "cpu"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # (not an xdist worker's name)
    env |= {"ASYNCLOAD_TEST_CPU": str(out), "PYTHONPATH": str(ROOT)}
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "harness.suite_cpu", "-p", "no:xdist",
         str(tmp_path / "test_tiny.py")],
        capture_output=True, text=True, timeout=100, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
    rows = {
        test.split("::")[1]: (own, kids, wall) for test, own, kids, wall in json.loads((out / "main.json").read_text())
    }
    assert set(rows) == {"test_child_burns", "test_sleeps"}
    assert rows["test_child_burns"][1] >= 0.35  # the child's 0.4 s, charged to the test that waited for it
    assert rows["test_sleeps"][1] < 0.05 and rows["test_sleeps"][0] < 0.1 and rows["test_sleeps"][2] >= 0.29
    text = summary(out)
    assert text.startswith("2 tests, ") and "min on 2 cores at the least" in text, text
    by_test = text.split("by test")[1].splitlines()[1:]
    assert by_test[0].endswith("test_tiny.py::test_child_burns"), text


def _imported_fixtures(path: Path) -> list[str]:
    """The pytest fixtures that the test module at ``path`` imports from a module of this package (``from
    .remote_fixtures import seaweed``): pytest makes such a fixture the importing module's own, so a
    "session" server started once per module that imported it (42 SeaweedFS servers a pass, with as many
    uploads, until 2026-11-30). Fixtures are registered once, in ``conftest.py``. (``_fixture_function_marker``
    marks a fixture in pytest 9; where it would not, the planted import below is not found and the test
    fails.)"""
    import ast
    import importlib

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.ImportFrom) or not node.module:
            continue
        if node.level == 1:
            name = f"tests.{node.module}"
        elif node.module.startswith("tests."):
            name = node.module
        else:
            continue
        module = importlib.import_module(name)
        for alias in node.names:
            if hasattr(getattr(module, alias.name, None), "_fixture_function_marker"):
                found.append(f"{path.name}: {alias.name} from {name}")
    return found


def test_no_test_module_imports_a_fixture_which_would_make_it_that_modules_own(tmp_path: Path) -> None:
    modules = sorted((ROOT / "tests").glob("test_*.py"))
    assert len(modules) > 50
    assert [f for p in modules for f in _imported_fixtures(p)] == []
    planted = tmp_path / "test_planted.py"  # the check itself finds one
    planted.write_text("from .remote_fixtures import seaweed, REMOTE_ROWS\nfrom .conftest import ROWS\n")
    assert _imported_fixtures(planted) == ["test_planted.py: seaweed from tests.remote_fixtures"]
