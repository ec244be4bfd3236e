"""``make wheelhouse``: the wheels a GPU node without internet needs to install asyncload, and nothing else.

Why: GPU clusters where segmentation data is sensitive (medical, defence, industrial) are often cut off
from any package index; such a node has Python, CUDA torch and torchvision, numpy, OpenCV and the like,
but not Deep Lake. This folder carries the project's own wheel and every runtime dependency the node lacks,
for the node's Python and platform (not this machine's), and is checked to install from itself alone.

How: the project's wheel is built (``pip wheel --no-deps``); its runtime requirements are followed
breadth-first, each downloaded alone (``pip download --no-deps --only-binary=:all:`` for the target
Python and platform) and its own ``Requires-Dist`` read from the wheel (markers evaluated for the target
Python), skipping what the node already has (``--has``: a file of distribution names, one per line); so
nothing the node has is downloaded, and every requirement of every wheel is either in the folder or on
the node. Then ``pip install --dry-run --no-index`` for the target checks that the wheels install there.
It prints each wheel and the total, and fails past ``--limit-mib`` (64 by default: the default "has" list
makes about 60 MiB for Python 3.11, Deep Lake 46 of it, and a packed OpenCV or torch, 54 MiB and more, fails).

What the operator installs is the folder's whole promise, so it holds, beside asyncload's runtime
dependencies: the ``check`` extra (pytest and pytest-timeout, which ``make gpu-check`` runs the CUDA
tests with) and a ``setuptools`` new enough for torch (torch 2.13 requires ``setuptools>=77.0.3``; a
fresh ``venv --system-site-packages`` carries its own, 65.5 in Python 3.11's, which hides the node's
newer one from pip, so without one in the folder the install stops at torch).

OpenCV comes as ``opencv-python`` or ``opencv-python-headless`` (or the contrib builds); each provides
``cv2``, which is all asyncload imports, but pip knows only the distribution's name, and asyncload asks
for the headless one. A line of the "has" file naming alternatives, ``opencv-python | opencv-python-headless``,
says the node has one of them: the folder's copy of asyncload's wheel then asks for none of them by name
(its ``Requires-Dist`` line is dropped, its ``RECORD`` updated), so it installs beside whichever the node
has, and none is packed (a headless build alone is 54 MiB).

    python harness/wheelhouse.py --python 3.12 --platform manylinux2014_x86_64 --has configs/gpu_node_has.txt --out wheelhouse

Then, on the node: ``pip install --no-index --find-links wheelhouse 'torch-asyncload[check]'``.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from collections import deque
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]

#: Packed whatever the "has" file says: a fresh virtual environment's own copy hides the node's (torch
#: 2.13's requirement; Python 3.11's venv brings setuptools 65.5).
VENV_HIDES = ("setuptools>=77.0.3",)


def node_has(path: Path) -> tuple[set[str], set[str]]:
    """The distributions the node has (one a line, ``#`` comments), and those named on a line of
    alternatives (``a | b``: the node has one of them, which one is not known here)."""
    has: set[str] = set()
    either: set[str] = set()
    for line in path.read_text().splitlines():
        names = [canonicalize_name(n.strip()) for n in line.split("#")[0].split("|") if n.strip()]
        has.update(names)
        if len(names) > 1:
            either.update(names)
    return has, either


def drop_requirements(wheel: Path, names: set[str]) -> list[str]:
    """Rewrite ``wheel`` without its ``Requires-Dist`` lines for ``names`` (its ``RECORD`` entry for the
    metadata updated, so that pip accepts it); the lines dropped."""
    with zipfile.ZipFile(wheel) as z:
        items = [(info, z.read(info)) for info in z.infolist()]
    files = {info.filename: data for info, data in items}
    meta = next(name for name in files if name.endswith(".dist-info/METADATA"))
    record = meta.rsplit("/", 1)[0] + "/RECORD"
    kept, dropped = [], []
    for line in files[meta].decode().splitlines(keepends=True):
        req = line.split(":", 1)[1].strip() if line.startswith("Requires-Dist:") else None
        (dropped if req and canonicalize_name(Requirement(req).name) in names else kept).append(line)
    if not dropped:
        return []
    body = "".join(kept).encode()
    digest = base64.urlsafe_b64encode(hashlib.sha256(body).digest()).rstrip(b"=").decode()
    rows = [
        f"{meta},sha256={digest},{len(body)}" if row.split(",")[0] == meta else row
        for row in files[record].decode().splitlines()
    ]
    new = {meta: body, record: ("\n".join(rows) + "\n").encode()}
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w") as z:
        for info, data in items:
            z.writestr(info, new.get(info.filename, data))
    tmp.replace(wheel)
    return [line.strip() for line in dropped]


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True
    )


#: What setuptools builds asyncload's wheel and sdist from (``pyproject.toml`` names no other file).
PACKAGE_FILES = ("pyproject.toml", "README.md", "LICENSE")


def package_copy(dest: Path) -> Path:
    """The files the package is built from (``PACKAGE_FILES`` and ``asyncload/``), copied into the new directory
    ``dest``: a build in the checkout writes its ``build/`` and ``*.egg-info`` there, and two at once (two
    test workers, a user's ``make wheelhouse`` beside a test run) collide in ``build/bdist.*/wheel`` ("File
    exists")."""
    dest.mkdir()
    for name in PACKAGE_FILES:
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "asyncload", dest / "asyncload", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def project_wheel(out: Path) -> subprocess.CompletedProcess[str]:
    """asyncload's wheel into ``out``, built from a private copy of the package's files (``package_copy``)."""
    with tempfile.TemporaryDirectory(prefix="asyncload-wheel-") as tmp:
        src = package_copy(Path(tmp) / "src")
        return pip("wheel", "--no-deps", "-q", "-w", str(out), str(src))


def requires(wheel: Path) -> list[str]:
    """The ``Requires-Dist`` lines of ``wheel``'s metadata."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def wanted(req: str, python: str) -> Requirement | None:
    """``req`` where it applies to a plain install on Linux with Python ``python`` (no extra), else None."""
    r = Requirement(req)
    if r.marker is None:
        return r
    env = default_environment() | {"python_version": python, "python_full_version": f"{python}.0",
                                   "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "extra": ""}  # fmt: skip
    return r if r.marker.evaluate(env) else None


def name_of(wheel: Path) -> str:
    return canonicalize_name(wheel.name.split("-")[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default="3.12", help="the node's Python, X.Y (default 3.12)")
    ap.add_argument("--platform", default="manylinux2014_x86_64", help="the node's platform tag")
    ap.add_argument("--has", type=Path, default=ROOT / "configs" / "gpu_node_has.txt", help="what the node has")
    ap.add_argument("--out", type=Path, default=ROOT / "wheelhouse")
    ap.add_argument("--limit-mib", type=float, default=64.0)
    ap.add_argument("--extras", default="check", help="asyncload's extras packed too, comma-separated (default: check)")
    a = ap.parse_args(argv)
    has, either = node_has(a.has)
    a.out.mkdir(parents=True, exist_ok=True)
    for old in a.out.glob("*.whl"):
        old.unlink()
    got = project_wheel(a.out)
    if got.returncode:
        print(got.stdout + got.stderr)
        return 1
    ours = next(a.out.glob("torch_asyncload-*.whl"))
    for line in drop_requirements(ours, either):
        print(f"{ours.name}: '{line}' dropped: the node has one of {', '.join(sorted(either))}")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [e for e in a.extras.split(",") if e]
    roots = [*project["dependencies"], *(r for e in extras for r in project["optional-dependencies"][e]), *VENV_HIDES]
    queue = deque(r for r in (wanted(x, a.python) for x in roots) if r is not None)
    hidden = {canonicalize_name(Requirement(r).name) for r in VENV_HIDES}
    seen: set[str] = {canonicalize_name(project["name"])}
    target = ["--only-binary=:all:", "--python-version", a.python, "--platform", a.platform, "--implementation", "cp"]
    while queue:
        req = queue.popleft()
        name = canonicalize_name(req.name)
        if name in seen or (name in has and name not in hidden):
            continue
        seen.add(name)
        before = set(a.out.glob("*.whl"))
        got = pip("download", "--no-deps", "-q", "-d", str(a.out), *target, str(req))
        if got.returncode:
            print(f"cannot download {req} for Python {a.python} on {a.platform}:\n{got.stderr[-2000:]}")
            return 1
        for wheel in set(a.out.glob("*.whl")) - before:
            queue.extend(r for r in (wanted(x, a.python) for x in requires(wheel)) if r is not None)
    wheels = sorted(a.out.glob("*.whl"))
    missing = sorted(
        {canonicalize_name(r.name) for w in wheels for r in (wanted(x, a.python) for x in requires(w)) if r is not None}
        - {name_of(w) for w in wheels} - has
    )  # fmt: skip
    if missing:
        print(f"offline install check: FAILED, required but neither in {a.out} nor on the node: {missing}")
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        got = pip("install", "--dry-run", "--no-index", "--no-deps", "--find-links", str(a.out), "--target", tmp,
                  *target, *[str(w) for w in wheels])  # fmt: skip
    if got.returncode:
        print(f"offline install check: FAILED for Python {a.python} on {a.platform}:\n{got.stderr[-3000:]}")
        return 1
    total = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    print(f"{total / 2**20:8.2f} MiB  total: {len(wheels)} wheels for Python {a.python} on {a.platform} in {a.out}")
    print(f"offline install check: ok (beside: {', '.join(sorted(has))})")
    wish = f"torch-asyncload[{','.join(extras)}]" if extras else "torch-asyncload"
    print(f"on the node: pip install --no-index --find-links {a.out.name} '{wish}'")
    if total > a.limit_mib * 2**20:
        print(f"the wheelhouse is {total / 2**20:.1f} MiB, over the limit of {a.limit_mib:g} MiB (--limit-mib)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
