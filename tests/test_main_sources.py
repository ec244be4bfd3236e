"""A ``Source`` subclass defined in the training script (``__main__``): read exactly, in this process with one
warning where a reader process could not import it, refused at construction where worker processes must have
it; never reported as a row that kills its reader (``runtime.mainmod``)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from asyncload.runtime.mainmod import _runs_at_import, main_names

from .conftest import ROWS

REPO = Path(__file__).resolve().parents[1]

CLASS = """
from asyncload import AsyncLoader, DeepLakeSource
class Old(DeepLakeSource):
    pass
"""

EPOCHS = """
def epochs(url, processes="auto"):
    seen = []
    with AsyncLoader(Old(url), batch_size=16, processes=processes, with_index=True, shuffle=True) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            rows = [i for b in loader for i in b["index"].tolist()]
            seen.append(sorted(rows) == list(range(len(Old(url)))))
    print("exact", seen)
"""

WARNING = "without crash isolation (processes='auto'): a reader process could not import Old from the script"


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=150, env=env)


@pytest.mark.timeout(160)
def test_a_notebook_style_subclass_reads_every_row_once_in_this_process_with_one_warning(seg_url, tmp_path) -> None:
    done = run(["-c", CLASS + EPOCHS + "epochs(__import__('sys').argv[1])", seg_url], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exact [True, True]" in done.stdout
    assert done.stderr.count(WARNING) == 1, done.stderr
    assert "the script has no file a new process could import (python -c" in done.stderr
    assert "define Old in a module" in done.stderr and "ReaderCrashError" not in done.stderr


@pytest.mark.timeout(160)
def test_a_class_defined_under_the_main_guard_is_read_here_and_named(seg_url, tmp_path) -> None:
    script = tmp_path / "train.py"
    body = CLASS.replace("class Old", "if __name__ == '__main__':\n  class Old").replace("    pass", "      pass")
    script.write_text(body + EPOCHS + "if __name__ == '__main__':\n    epochs(__import__('sys').argv[1])\n")
    done = run([str(script), seg_url], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exact [True, True]" in done.stdout
    assert done.stderr.count(WARNING) == 1
    assert f"{script} does not define Old at its top level" in done.stderr


@pytest.mark.timeout(160)
def test_a_guarded_script_keeps_its_reader_process(seg_url, tmp_path) -> None:
    script = tmp_path / "train.py"
    probe = "\nimport asyncload.processes.isolated as iso\n_start = iso.IsolatedSource.start\n"
    probe += "def start(self, *a, **k):\n    print('reader started', flush=True)\n    return _start(self, *a, **k)\n"
    probe += "iso.IsolatedSource.start = start\n"
    script.write_text(CLASS + probe + EPOCHS + "if __name__ == '__main__':\n    epochs(__import__('sys').argv[1])\n")
    done = run([str(script), seg_url], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "exact [True, True]" in done.stdout and "reader started" in done.stdout
    assert "crash isolation" not in done.stderr


@pytest.mark.timeout(160)
def test_worker_processes_that_cannot_have_the_class_are_refused_at_construction(seg_url, tmp_path) -> None:
    done = run(["-c", CLASS + EPOCHS + "epochs(__import__('sys').argv[1], processes=2)", seg_url], tmp_path)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "asyncload.errors.ConfigError: processes=2 cannot send Old to its worker processes: the script has no file "
        "a new process could import (python -c, an interactive session or a notebook); define Old in a module (a "
        ".py file the script imports) so that a new process can import it, or pass processes=0"
    )


class _Here:
    pass


def test_the_names_a_pickle_takes_from_main_are_read_off_its_opcodes(monkeypatch) -> None:
    import types

    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    for name in ("Old", "transform"):
        obj = type(name, (), {}) if name == "Old" else (lambda: None)
        obj.__module__, obj.__qualname__ = "__main__", name
        setattr(main, name, obj)
    for proto in (2, 4, 5):
        pickled = pickle.dumps([main.Old(), main.Old, main.transform, ROWS, "__main__"], protocol=proto)
        assert main_names(pickled) == ["Old", "transform"], proto
    assert main_names(pickle.dumps(_Here())) == []


def test_work_at_import_is_found_outside_the_guard_only() -> None:
    import ast

    guarded = "import x\nclass A: pass\nN = f()\nif __name__ == '__main__':\n    for b in x: pass\n"
    assert _runs_at_import(ast.parse(guarded).body) is None
    assert _runs_at_import(ast.parse("import x\nx.run()\n").body) == 2
    assert _runs_at_import(ast.parse("if True:\n    for b in x: pass\n").body) == 2
