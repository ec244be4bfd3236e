"""What a GPU node without internet needs: ``import asyncload`` and a JPEG + lz4 epoch with neither
``imagecodecs`` nor ``pyspng`` (PNG falls back to OpenCV's libpng, said once); and ``make wheelhouse``'s
folder, built for this Python, installs offline into a fresh virtual environment that reads a dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

WITHOUT_CODECS = """
import sys
sys.modules["imagecodecs"] = None  # not installed, as on a node given only the wheelhouse
sys.modules["pyspng"] = None
import json, logging
records = []
h = logging.Handler(); h.emit = lambda r: records.append(r.getMessage())
logging.getLogger("asyncload").addHandler(h); logging.getLogger("asyncload").setLevel(logging.INFO)
import numpy as np
import deeplake
import asyncload
from asyncload import AsyncLoader, DeepLakeSource
out = {}
for fmt in sys.argv[2].split(","):
    url = asyncload.make_dataset(sys.argv[1] + "/" + fmt, 40, height=24, width=32, image_format=fmt, progress=False)
    ds = deeplake.open_read_only(url)
    loader = AsyncLoader(DeepLakeSource(url), batch_size=8, shuffle=True, processes=0, cache=False)
    rows = 0
    for b in loader:
        for k, i in enumerate(b["index"].tolist()):
            if fmt == "png":  # lossless: the pixels are Deep Lake's own
                assert np.array_equal(b["images"][k].numpy(), np.asarray(ds[i]["images"]))
            assert np.array_equal(b["masks"][k].numpy(), np.asarray(ds[i]["masks"]))
            rows += 1
    loader.close()
    out[fmt] = rows
out["said"] = [m for m in records if "imagecodecs" in m]  # (said at the first PNG decoded)
out["imported"] = "imagecodecs" in sys.modules and sys.modules["imagecodecs"] is not None
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_jpeg_and_png_epochs_need_no_optional_codec(tmp_path) -> None:
    got = subprocess.run(
        [sys.executable, "-c", WITHOUT_CODECS, str(tmp_path), "jpg,png"],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert (out["jpg"], out["png"]) == (40, 40) and not out["imported"]
    assert len(out["said"]) == 1 and "OpenCV's libpng" in out["said"][0] and "torch-asyncload[png]" in out["said"][0]


@pytest.mark.timeout(420)
def test_a_wheelhouse_for_this_python_installs_offline_and_reads(tmp_path) -> None:
    """The folder ``make wheelhouse`` writes, for the running Python, with this environment's packages as
    what the node already has (but imagecodecs, which the node lacks and the wheelhouse leaves out): a
    fresh virtual environment that sees those packages installs asyncload from it with no index, and reads
    a JPEG + lz4 epoch from a directory outside the checkout."""
    house = tmp_path / "wheelhouse"
    has = tmp_path / "has.txt"
    site = sysconfig.get_paths()["purelib"]
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze", "--exclude-editable"], capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    names = [line.split("==")[0] for line in installed.splitlines() if "==" in line]
    keep_out = {"imagecodecs", "torch-asyncload", "asyncload"}
    has.write_text("\n".join(n for n in names if n.lower() not in keep_out) + "\n")
    v = f"{sys.version_info.major}.{sys.version_info.minor}"
    built = subprocess.run(
        [sys.executable, str(ROOT / "harness" / "wheelhouse.py"), "--python", v, "--has", str(has), "--out", str(house)],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = sorted(p.name for p in house.glob("*.whl"))
    assert any(w.startswith("torch_asyncload-") for w in wheels), wheels
    assert not any(w.startswith("imagecodecs") for w in wheels)
    assert any(w.startswith("setuptools-") for w in wheels)  # though "has" lists it: a fresh venv's hides the node's
    assert "total" in built.stdout and "offline install check: ok" in built.stdout
    venv = tmp_path / "node"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    vsite = next((venv / "lib").glob("python3*/site-packages"))
    # the node's own packages: this environment's, seen through a path file, imagecodecs hidden
    (vsite / "node_has.pth").write_text(f"{site}\nimport sys; sys.modules['imagecodecs'] = None\n")
    py = venv / "bin" / "python"
    env = {k: val for k, val in os.environ.items() if not k.startswith("PIP_")} | {"PIP_NO_INDEX": "1"}
    subprocess.run(
        [str(py), "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", str(house), "-q",
         *[str(p) for p in house.glob("*.whl")]],
        check=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    got = subprocess.run(
        [str(py), "-c", WITHOUT_CODECS, str(tmp_path / "data"), "jpg"],
        capture_output=True, text=True, timeout=200, cwd=tmp_path,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-3000:]
    out = json.loads(got.stdout.strip().splitlines()[-1])
    assert out["jpg"] == 40 and not out["said"]  # a JPEG + lz4 epoch asks for no PNG decoder
    where = subprocess.run(
        [str(py), "-c", "import asyncload; print(asyncload.__file__)"], capture_output=True, text=True, cwd=tmp_path
    ).stdout
    assert str(vsite) in where, where  # the wheel's copy, not the checkout's


@pytest.mark.timeout(180)
def test_a_node_with_either_opencv_build_gets_a_wheel_that_names_neither(tmp_path) -> None:
    """The default "has" file says the node has one of the OpenCV builds, not which: the wheelhouse's copy
    of asyncload's wheel then asks for none of them by name (each provides ``cv2``), and stays a valid
    wheel: its ``RECORD`` holds the rewritten metadata's hash and size, its other files untouched."""
    import base64
    import hashlib
    import zipfile

    from harness.wheelhouse import drop_requirements, node_has, project_wheel, requires

    has, either = node_has(ROOT / "configs" / "gpu_node_has.txt")
    assert {"opencv-python", "opencv-python-headless"} <= either and {"torch", "numpy"} <= has - either
    built = project_wheel(tmp_path)  # (as make wheelhouse builds it: from a copy, beside other builds)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = tmp_path.glob("torch_asyncload-*.whl")
    before = {i.filename: zipfile.ZipFile(wheel).read(i) for i in zipfile.ZipFile(wheel).infolist()}
    assert any(r.startswith("opencv-python-headless") for r in requires(wheel))
    assert drop_requirements(wheel, either) == ["Requires-Dist: opencv-python-headless>=4.8"]
    left = requires(wheel)
    assert not any(r.startswith("opencv") for r in left) and any(r.startswith("deeplake") for r in left)
    with zipfile.ZipFile(wheel) as z:
        after = {i.filename: z.read(i) for i in z.infolist()}
    meta = next(n for n in after if n.endswith(".dist-info/METADATA"))
    rows = after[meta.replace("METADATA", "RECORD")].decode().split()
    record = {row.split(",")[0]: row.split(",")[1:] for row in rows}
    digest = base64.urlsafe_b64encode(hashlib.sha256(after[meta]).digest()).rstrip(b"=").decode()
    assert record[meta] == [f"sha256={digest}", str(len(after[meta]))]
    assert {n: d for n, d in after.items() if not n.endswith(("METADATA", "RECORD"))} == {
        n: d for n, d in before.items() if not n.endswith(("METADATA", "RECORD"))
    }
    assert drop_requirements(wheel, either) == []  # nothing left to drop: the wheel is left as it is


@pytest.mark.timeout(180)
def test_two_wheel_builds_at_once_both_succeed_and_write_nothing_in_the_checkout(tmp_path) -> None:
    """``make wheelhouse`` builds asyncload's wheel from a copy of the package's files: two builds at once (two
    test workers, or a user's build beside a test run) collided in the checkout's ``build/bdist.*/wheel``
    ("File exists"), and a build left ``build/`` and ``*.egg-info`` behind in the checkout."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from harness.wheelhouse import project_wheel

    def written_since(t0: float) -> list[str]:
        out = []
        for top in [ROOT / "build", *ROOT.glob("*.egg-info")]:
            for p in [top, *top.rglob("*")] if top.exists() else []:
                if p.lstat().st_mtime >= t0:
                    out.append(str(p.relative_to(ROOT)))
        return out

    t0 = time.time() - 1e-3
    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(project_wheel, [tmp_path / "a", tmp_path / "b"]))
    for g in got:
        assert g.returncode == 0, g.stdout[-3000:] + g.stderr[-3000:]
    assert [len(list((tmp_path / d).glob("torch_asyncload-*.whl"))) for d in "ab"] == [1, 1]
    assert written_since(t0) == []
