"""The operator of ``docs/guides/air-gapped-gpu.md``, in CI: the page's commands, as written, from a fresh
node to ``make gpu-check``'s results folder, on a node that has nothing but what
``configs/gpu_node_has.txt`` lists and the wheelhouse.

The node is simulated as closely as one machine allows: its Python is this test's base interpreter, whose
system site-packages are replaced (a bind mount in a mount namespace of the test's own) by a folder
holding only the "has" list and what it requires (the CPU torch 2.13.0 standing for the node's CUDA build,
``opencv-python`` where OpenCV is a choice: the build asyncload does not ask for by name; linked from this
environment where it has them); the network is cut (a network
namespace: no DNS, no index, nothing), pip's configuration ignored (``PIP_CONFIG_FILE=/dev/null``,
``PIP_NO_INDEX=1``, a fresh ``HOME``). On the connected side the wheelhouse is built for this Python from
PyPI (once per session) and the checkout packed with the page's own ``tar`` line. Then the page's node
commands run one by one, ``make gpu-check`` in its quick form, and the results folder must hold a run in
which every part ran and the GPU parts are said to be skipped. Needs root (``unshare``); skipped otherwise.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guides" / "air-gapped-gpu.md"
BLOCK = re.compile(r"^<!-- (connected|node) -->\n```bash\n(.*?)^```", re.S | re.M)
LEFT_BEHIND = shutil.ignore_patterns(  # what a fresh clone lacks (.gitignore): the checkout as the operator has it
    ".venv", ".git", "data", "wheelhouse", "_build", "build", "checkpoints", "*.egg-info", "__pycache__", ".pytest_cache",
    "core", "core.*",
)  # fmt: skip

# Its own group: one worker runs it (about two minutes of mostly CPU) while the others go on.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("operator")]


def commands(side: str) -> list[str]:
    """The page's commands for ``side`` (``connected`` or ``node``), one a line, comments dropped."""
    blocks = [body for name, body in BLOCK.findall(PAGE.read_text()) if name == side]
    assert len(blocks) == 1, f"{PAGE.name} has {len(blocks)} blocks marked <!-- {side} -->"
    return [line.split("  #")[0].strip() for line in blocks[0].splitlines() if line.strip()]


def namespaces_allowed() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(["unshare", "-m", "-n", "true"]).returncode == 0


def installed_closure(names: list[str]) -> tuple[list[importlib.metadata.Distribution], list[str]]:
    """Of ``names`` (distributions), those installed in this environment with every distribution they
    require here, transitively (markers evaluated, extras not followed); and the names not installed."""
    from packaging.utils import canonicalize_name

    from harness.wheelhouse import wanted

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    here = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    found: dict[str, importlib.metadata.Distribution] = {}
    missing = [n for n in names if canonicalize_name(n) not in here]
    todo = [canonicalize_name(n) for n in names if canonicalize_name(n) in here]
    while todo:
        name = todo.pop()
        if name in found:
            continue
        found[name] = here[name]
        for line in here[name].requires or []:
            req = wanted(line, python)
            if req is not None:
                dep = canonicalize_name(req.name)
                assert dep in here, f"{name} requires {req}, which this environment lacks"
                todo.append(dep)
    return list(found.values()), missing


def link_installed(dists: list[importlib.metadata.Distribution], site: Path) -> None:
    """Each of ``dists``' top-level entries (packages, modules, its .dist-info folder) as a link in ``site``:
    installed as this environment has them, without unpacking and compiling them again (torch alone is
    1.2 GB of files)."""
    owner: dict[str, str] = {}
    for d in dists:
        name = d.metadata["Name"]
        for top in {Path(str(f)).parts[0] for f in d.files or []} - {"..", "__pycache__"}:  # (bin/; bytecode)
            assert owner.setdefault(top, name) == name, f"{top} is both {owner[top]}'s and {name}'s"
            src = Path(str(d.locate_file(top)))
            if src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)


@pytest.fixture(scope="session")
def node_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The node's own packages: every line of the "has" list (its first name where a line gives a choice),
    torch pinned as CI pins it. Those this environment has, with what they require, are linked from it
    (the same files an install would write); the others (``opencv-python``, torchvision) are installed from
    this machine's usual sources at the versions pip resolves for the whole list, without their
    dependencies, which the linked ones are."""
    site = tmp_path_factory.mktemp("node-site")
    has = ROOT / "configs" / "gpu_node_has.txt"
    names = [n for n in (line.split("#")[0].split("|")[0].strip() for line in has.read_text().splitlines()) if n]
    dists, missing = installed_closure(names)
    link_installed(dists, site)
    if missing:  # at the versions pip picks for the whole list (torchvision's latest may want a newer torch)
        pip = [sys.executable, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt")]
        plan = subprocess.run(
            [*pip, "--dry-run", "--ignore-installed", "--report", "-", *names],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert plan.returncode == 0, plan.stderr[-3000:]
        versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in json.loads(plan.stdout)["install"]}
        pinned = [f"{n}=={versions[n.lower()]}" for n in missing]
        got = subprocess.run(
            [*pip, "--no-deps", "--target", str(site), *pinned], capture_output=True, text=True, timeout=600
        )
        assert got.returncode == 0, got.stderr[-3000:]
    return site


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``make wheelhouse``'s folder for this Python, with the default "has" list: downloaded once a session."""
    out = tmp_path_factory.mktemp("wheels") / "wheelhouse"
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run(
        [sys.executable, str(ROOT / "harness" / "wheelhouse.py"), "--python", v, "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


def base_python() -> tuple[Path, list[str]]:
    """This interpreter's base installation (the node's Python): its ``bin`` folder and its system
    site-packages folders."""
    exe = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    sites = subprocess.run(
        [str(exe), "-I", "-c", "import site; print('\\n'.join(site.getsitepackages()))"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()  # fmt: skip
    return exe.parent, [s for s in sites if os.path.isdir(s)]


@pytest.mark.skipif(not namespaces_allowed(), reason="needs unshare -m -n (root): the node's site and network")
def test_the_operator_page_runs_from_the_wheelhouse_alone_to_a_results_folder(
    node_site: Path, wheelhouse: Path, tmp_path: Path
) -> None:
    connected, node = commands("connected"), commands("node")
    assert len(node) <= 4, node  # the page's promise: at most 4 commands from a fresh node to the results
    assert any(c.startswith("make wheelhouse") for c in connected), connected
    # the connected side: the checkout (as cloned, nothing built), its wheelhouse, then the page's packing
    checkout = tmp_path / "connected" / "asyncload"
    shutil.copytree(ROOT, checkout, ignore=LEFT_BEHIND, symlinks=True)
    shutil.copytree(wheelhouse, checkout / "wheelhouse")
    for line in connected:
        if not line.startswith("make wheelhouse"):  # (built above, as make wheelhouse runs it, once a session)
            subprocess.run(line, shell=True, check=True, cwd=checkout, timeout=120)
    packed = list((tmp_path / "connected").glob("*.tgz"))
    assert len(packed) == 1, packed
    on_node = tmp_path / "node"
    on_node.mkdir()
    shutil.move(packed[0], on_node / packed[0].name)
    # the node: its Python's site-packages are the "has" list alone; no network; no pip configuration
    bindir, sites = base_python()
    empty = tmp_path / "empty"
    empty.mkdir()
    mounts = [f"mount --bind {node_site} {sites[0]}", *[f"mount --bind {empty} {s}" for s in sites[1:]]]
    quick = f'GPU_CHECK_ARGS="--quick --data {tmp_path / "gpu-check-data"}"'
    steps = [f"{c} {quick}" if c == "make gpu-check" else c for c in node]
    script = " && ".join(["set -x", *mounts, *steps])
    env = {
        "PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(tmp_path / "home"), "LANG": "C.UTF-8",
        "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }  # fmt: skip
    ran = subprocess.run(
        ["unshare", "-m", "-n", "bash", "-c", script], capture_output=True, text=True, cwd=on_node, env=env, timeout=780
    )
    (tmp_path / "node.log").write_text(ran.stdout + ran.stderr)  # the whole of it, for a failure's reader
    said = ran.stdout[-6000:] + ran.stderr[-4000:]
    assert ran.returncode == 0, said
    found = re.findall(r"^results: (\S+) \(every part ran\)$", ran.stdout, re.M)
    assert found, said
    folder = Path(found[-1])
    assert folder.parent == (on_node / "asyncload" / "benchmarks" / "results" / "gpu_check").resolve(), folder
    summary = (folder / "summary.md").read_text()
    assert (folder / "results.json").exists()
    assert "no CUDA device: the GPU parts are skipped" in summary, summary
    assert re.search(r"CUDA tests: \d+ passed, \d+ skipped", summary), summary
    assert "FAILED" not in summary and "decode=cuda, processes=4" in summary and "U-Net epoch" in summary, summary
    # the node's asyncload is the wheelhouse's, installed beside the node's opencv-python and no other
    py = on_node / "asyncload" / ".venv" / "bin" / "python"
    freeze = subprocess.run(
        ["unshare", "-m", "bash", "-c", f"{mounts[0]} && {py} -m pip list --format=freeze"],
        capture_output=True, text=True, env=env, timeout=120,
    ).stdout.lower()  # fmt: skip
    assert "torch-asyncload==" in freeze and "opencv-python==" in freeze and "opencv-python-headless" not in freeze


def test_a_failing_part_of_gpu_check_leaves_its_reason_in_the_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    """A run on a borrowed GPU must say why a part failed without a second run: pytest's own complaint
    (here a test file the checkout lacks) is kept, and the other parts still report."""
    from benchmarks.suites import gpu_check

    monkeypatch.setattr(gpu_check, "CUDA_TESTS", ("tests/test_not_there.py",))
    parts: dict = {}
    assert gpu_check.part("cuda_tests", gpu_check.cuda_tests, parts) is None
    assert gpu_check.part("data", lambda: {"url": "file:///x", "rows": 8, "bytes_per_pair": 2e4}, parts)["rows"] == 8
    res = {"machine": {"gpu": "no GPU", "cpus": 2, "python": "3", "torch": "2"}, "cuda": False, "seconds": 1.0, "parts": parts}  # fmt: skip
    text = gpu_check.summary(res, ["no CUDA device"])
    assert "CUDA tests: FAILED" in text and "## cuda_tests: FAILED" in text, text
    assert "pytest exited 4" in text and "file or directory not found: tests/test_not_there.py" in text, text
    assert "8 rows of photo-like" in text and "20.0 KB a pair" in text, text
