"""The package as a user gets it: a wheel and an sdist built from this tree, the wheel installed into a new
virtual environment outside the repository, and the installed ``asyncload`` command run from there.

Why the dependencies come from the project's ``.venv``: installing torch and Deep Lake again would take
minutes. The new environment has no pip packages of its own but the wheel (installed ``--no-deps``); a
``.pth`` file appends the project environment's site-packages to its path *after* its own, and a path
in a ``.pth`` file is added without running the ``.pth`` files inside it, so the project's editable
install of asyncload (a ``.pth`` finder) is not seen: ``asyncload.__file__`` is checked to be the
installed copy, and every command runs from a temporary directory with no checkout in sight.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(240)


def _run(argv: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 120) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def build(tmp: Path) -> tuple[Path, Path]:
    """The wheel and the sdist, built by setuptools' PEP 517 hooks from a copy of the tree's package files
    (``harness.wheelhouse.package_copy``: the build leaves nothing in the checkout)."""
    from harness.wheelhouse import package_copy

    src = package_copy(tmp / "src")
    dist = tmp / "dist"
    built = []
    for hook in ("build_wheel", "build_sdist"):  # one process each: setuptools keeps state between them
        code = f"import sys; from setuptools import build_meta as b; print('BUILT', b.{hook}(sys.argv[1]))"
        out = _run([sys.executable, "-c", code, str(dist)], cwd=src)  # setuptools talks on stdout too
        built.append(next(ln for ln in out.splitlines() if ln.startswith("BUILT ")).split()[1])
    wheel, sdist = built
    return dist / wheel, dist / sdist


@pytest.mark.timeout(300)
def test_the_wheel_installs_outside_the_repository_and_its_commands_run(tmp_path: Path) -> None:
    wheel, sdist = build(tmp_path)
    assert wheel.name.startswith("torch_asyncload-") and sdist.name.startswith("torch_asyncload-")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert (
        "asyncload/tools/train/configs/train_unet.yaml" in names
        and "asyncload/tools/train/configs/train_unet_photos.yaml" in names
    )
    assert "Name: torch-asyncload" in meta and "asyncload/py.typed" in names
    with tarfile.open(sdist) as t:
        assert any(n.endswith("asyncload/tools/train/configs/train_unet.yaml") for n in t.getnames())

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    site = Path(
        _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).strip()
    )
    (site / "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # torch, deeplake, ...
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--no-index", "-q", str(wheel)],
         cwd=tmp_path)  # fmt: skip

    work = tmp_path / "elsewhere"  # no checkout, no configs/ folder here
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env.get('PATH', '')}"
    where = _run([str(py), "-c", "import asyncload; print(asyncload.__file__)"], cwd=work, env=env).strip()
    assert where == str(site / "asyncload" / "__init__.py"), where
    exe = str(venv / "bin" / "asyncload")
    from asyncload import __version__

    assert _run([exe, "--version"], cwd=work, env=env).strip() == f"asyncload {__version__}"
    # the benchmark suite needs a checkout's benchmarks/: an install does not offer it, nor dead-ends in it
    helped = _run([exe, "--help"], cwd=work, env=env)
    assert "make-dataset" in helped and "bench" not in helped, helped
    _run([exe, "make-dataset", "small", "--rows", "40", "--size", "32"], cwd=work, env=env)
    out = _run([exe, "load", "small", "--batch-size", "8", "--sequential-rows", "8", "--processes", "0"],
               cwd=work, env=env)  # fmt: skip
    assert "| asyncload column reads, concurrency auto, processes 0 | 40 |" in out and "local disk" in out
    out = _run(
        [exe, "train", "--epochs", "1", "--set", "rows=64", "--set", "model_only_steps=0", "--checkpoint", "null",
         "--set", "progress=false"],
        cwd=work, env=env, timeout=180,
    )  # fmt: skip
    assert "making 64 synthetic rows" in out and "epoch 1/1" in out, out  # the shipped train_unet config, found by name
    assert "4 classes from metadata of column 'masks': background, circle, rectangle, triangle" in out
    assert not (work / "configs").exists() and (work / "data" / "synthetic-seg-64").is_dir()
