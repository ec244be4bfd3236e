"""The documentation site (``docs/``, ``make docs``), kept true by tests: it builds with Sphinx as strictly
as ``make docs`` does (a warning, a broken cross-reference, a public name without an API page fails),
every name of ``asyncload.__all__`` has its page, and the examples marked ``<!-- run -->`` in the README
and the guides run as written, as scripts, against real data: a small synthetic Deep Lake dataset at
``data/seg`` (where the pages say ``asyncload make-dataset data/seg`` puts it) and image files in
``s3://my-bucket/photos`` on the suite's SeaweedFS server, reached through the standard ``AWS_*``
variables the pages tell users to set."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import asyncload
from asyncload import make_dataset

from .remote_fixtures import originals, upload_files

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)]
# exactly what `make docs` runs (the Makefile's SPHINXOPTS), into a folder of the test's own
STRICT = ["-W", "--keep-going", "-n", "-E", "-q"]
RUN = re.compile(r"^<!-- run -->\n```python\n(.*?)^```", re.S | re.M)
INCLUDED = re.compile(r"^<!-- run -->\n```\{literalinclude\} (\S*\bexamples/\S+?\.py)$", re.M)  # an example a page runs
PYTHON = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def sphinx(out: Path, *extra: str, builder: str = "html", prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"import sys; {prelude}from sphinx.cmd.build import main; sys.exit(main(sys.argv[1:]))"
    argv = [*STRICT, *extra, "-b", builder, "-d", str(out / "doctrees"), str(DOCS), str(out / "html")]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=150, env=env)


@pytest.mark.timeout(240)
def test_the_site_builds_strictly_with_a_page_for_every_public_name(tmp_path: Path) -> None:
    """One test, two builds, one after another (both write the generated API pages into docs/api)."""
    done = sphinx(tmp_path / "ok")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    html = tmp_path / "ok" / "html"
    for name in asyncload.__all__:
        page = html / "api" / "generated" / f"{name}.html"
        assert page.exists(), f"asyncload.{name} has no API page"
        assert f'id="asyncload.{name}"' in page.read_text(), f"asyncload.{name}'s page documents nothing"
    assert "stall_timeout" in (html / "api" / "generated" / "AsyncLoader.html").read_text()  # settings, from help()
    for guide in ("own-data", "writing-a-source", "training-loops", "images", "larger-than-memory",
                  "mixing-and-resume", "failures", "performance", "cli"):  # fmt: skip
        assert (html / "guides" / f"{guide}.html").exists(), guide
    assert "The node-local block store" in (html / "guides" / "larger-than-memory.html").read_text()
    for page in ("quickstart", "guides/from-dataloader", "reference", "troubleshooting", "glossary"):
        assert (html / f"{page}.html").exists(), page
    reference = (html / "reference.html").read_text()  # its tables, generated from the code at the build
    for name in ("shutdown_timeout", "mp_context", "request_size", "cache_limit", "bytes_per_s", "XDG_CACHE_HOME"):
        assert name in reference, name

    # the same build fails on a broken cross-reference and on a public name that documents nothing
    broken = sphinx(
        tmp_path / "broken",
        "-D",
        "rst_epilog=See :py:class:`asyncload.NoSuchLoader`.",
        builder="dummy",  # reads and resolves every page as html does, writes nothing
        prelude="import asyncload; asyncload.__all__.append('NoSuchName'); ",
    )
    assert broken.returncode != 0
    assert "asyncload.NoSuchLoader" in broken.stderr and "NoSuchName" in broken.stderr, broken.stderr[-3000:]
    stale = DOCS / "api" / "generated" / "NoSuchName.rst"
    stale.unlink(missing_ok=True)  # the failed build's page for the name that does not exist


def examples() -> dict[str, str]:
    """The runnable blocks of the README and the guides, by ``page:line``, and the example files a page
    shows in parts (``{literalinclude}``, e.g. ``examples/custom_source.py``), whole, by their path."""
    found = {}
    for page in PAGES:
        text = page.read_text()
        for m in RUN.finditer(text):
            found[f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 2}"] = m.group(1)
        for m in INCLUDED.finditer(text):
            path = (page.parent / m.group(1)).resolve()
            found[str(path.relative_to(ROOT))] = path.read_text()
    return found


def test_the_pages_install_this_project_and_start_deep_lake_workers_safely() -> None:
    """Every install line names the distribution (``torch-asyncload``, not another project's
    ``asyncload``); every example that starts DataLoader workers names ``multiprocessing_context``."""
    for page in PAGES:
        text = page.read_text()
        for block in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M):
            for line in re.findall(r"^pip install .*", block, re.M):
                assert "torch-asyncload" in line, f"{page.name}: {line}"
        for name in re.findall(r"pip install \"?([\w.-]+)\[", text):  # extras, in prose or code
            assert name == "torch-asyncload", f"{page.name}: pip install {name}[...]"
        for block in PYTHON.findall(text):
            if "DataLoader(" in block and "num_workers" in block:
                assert "multiprocessing_context" in block, f"{page.name}: a DataLoader example without it:\n{block}"
    runnable = "\n".join(examples().values())
    for must in ("multiprocessing_context", "StatefulDataLoader", 'ObjectStoreSource("s3://', "load_state_dict"):
        assert must in runnable, f"no runnable example uses {must}"


DRIVER = """
import gc, runpy, sys, time, traceback
failed = []
for path in sys.argv[1:]:
    t = time.perf_counter()
    try:
        runpy.run_path(path, run_name="__main__")   # as `python path`: spawned workers import it as __mp_main__
    except BaseException:
        failed.append(path)
        print(f"FAILED {path}", file=sys.stderr)
        traceback.print_exc()
    gc.collect()
    print(f"{path}: {time.perf_counter() - t:.1f} s", flush=True)
sys.exit(1 if failed else 0)
"""


@pytest.mark.timeout(300)
def test_the_examples_of_the_readme_and_the_guides_run_as_written(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    blocks = examples()
    assert len(blocks) >= 8, sorted(blocks)
    make_dataset(str(tmp_path / "data" / "seg"), 160, height=48, width=64, progress=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "PYTHONPATH"}
    try:
        server = request.getfixturevalue("seaweed")
    except pytest.skip.Exception:  # no SeaweedFS binary: the local examples still run
        server = None
        blocks = {where: code for where, code in blocks.items() if "s3://" not in code}
    else:
        server.create_bucket("my-bucket")
        upload_files(server, "my-bucket", "photos", *originals(24))
        env |= server.env()

    scripts = []
    for i, (where, code) in enumerate(blocks.items()):
        script = tmp_path / f"example_{i:02d}.py"
        script.write_text(f"# {where}\n{code}")
        scripts.append(script.name)
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, *scripts], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280
    )
    where = {f"example_{i:02d}.py": w for i, w in enumerate(blocks)}
    failed = [where[ln.split()[1]] for ln in done.stderr.splitlines() if ln.startswith("FAILED ")]
    print(done.stdout)  # each example and its seconds (pytest -s, or -rP, shows them)
    assert done.returncode == 0, f"examples failed: {failed}\n{done.stdout[-2000:]}\n{done.stderr[-6000:]}"
    if server is None:
        pytest.skip("SeaweedFS is not installed: the object-store examples did not run (the local ones passed)")
