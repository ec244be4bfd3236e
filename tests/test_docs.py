"""Documentation where users look, kept true by tests: ``help(AsyncLoader)`` lists every setting (the one
list; a setting added to ``LoaderOptions`` without a line there fails here), ``help(ObjectStoreSource)``
and the guide to your own data give the object-store layout and rules, and the smaller messages of issue 35."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncload import AsyncLoader, LoaderOptions
from asyncload.errors import ConfigError
from asyncload.sources.objectstore import ObjectStoreSource

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
OWN_DATA = (ROOT / "docs" / "guides" / "own-data.md").read_text()
pytestmark = pytest.mark.timeout(60)


def documented_settings(doc: str) -> set[str]:
    """The names a settings line of ``AsyncLoader``'s docstring starts with (``shuffle, seed  ...``)."""
    names: set[str] = set()
    for line in doc.splitlines():
        m = re.match(r"^ {6}([a-z_]+(?:, [a-z_]+)*) ", line)
        if m:
            names.update(m.group(1).split(", "))
    return names


def test_help_asyncloader_documents_every_setting() -> None:
    doc = AsyncLoader.__doc__ or ""
    missing = [f.name for f in dataclasses.fields(LoaderOptions) if f.name not in documented_settings(doc)]
    assert not missing, f"settings of LoaderOptions without a line in AsyncLoader's docstring: {missing}"
    for name in ("decode", "augment", "normalize", "layout", "dtype", "memory_budget", "cpu_workers", "stall_timeout"):
        assert name in documented_settings(doc)
    assert "logging.basicConfig" in doc and "forkserver" in doc  # log_every's condition; what close() leaves


def test_help_objectstoresource_and_the_guide_give_the_layout_listing_pairing_and_manifest() -> None:
    doc = ObjectStoreSource.__doc__ or ""
    for words in ("<prefix>/<column>/<stem>.<ext>", "**Listing**", "**Pairing**", "**Manifest**", "sorted"):
        assert words in doc, words
    for words in ("<prefix>/<column>/<stem>.<ext>", "pair across columns by stem", "manifest"):
        assert words in OWN_DATA, words


def test_the_readme_installs_this_project_and_contributing_says_how_long_make_test_takes() -> None:
    """The README is for users (install, the two commands, a first loop, where to read on); how the suite
    runs, in detail, is in CONTRIBUTING.md."""
    assert "pip install torch-asyncload" in README and "pip install asyncload " not in README
    assert 'name = "torch-asyncload"' in (ROOT / "pyproject.toml").read_text()
    assert "docs/quickstart.md" in README and "bring your own torch" not in README
    assert re.search(r"`make test`[^.]*minutes on 2 cores", (ROOT / "CONTRIBUTING.md").read_text())
    assert not re.search(r"xdist|--dist loadgroup|crash_report", README)
    for command in ("make run", "make test"):  # the two set-up commands, with what they print and take
        assert re.search(rf"^{command} +# ", README, re.M) and f"**`{command}`**" in README, command
    assert "It prints:" in README and re.search(
        r"`make test`.*?\d+-\d+ minutes on this project's 2-core machine", README, re.S
    )


def reference_tables():  # docs/reference_tables.py: what docs/conf.py renders the reference tables with
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import reference_tables
    finally:
        sys.path.remove(str(ROOT / "docs"))
    return reference_tables


def test_the_settings_table_has_every_setting_with_its_rule_and_default() -> None:
    """docs/reference.md's settings: one row per field of LoaderOptions (and AsyncLoader's rank,
    world_size, shard), with what it takes, its default and the docstring's words."""
    tables = reference_tables()
    md = tables.settings_md()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", md, re.M)}
    for f in dataclasses.fields(LoaderOptions):
        assert f.name in rows, f"{f.name} has no row in the reference's settings table"
        row = rows[f.name]
        assert f"| `{f.default!r}` |" in row, (f.name, row)
        assert not row.endswith("|  |"), f"{f.name}: no description"
        assert "| a Any |" not in row, f"{f.name}: say what it takes with setting(..., allowed)"
    for name in ("rank", "world_size", "shard"):
        assert name in rows
    for name in ("cache_limit", "cache_dir", "cache", "mp_context", "request_size", "shutdown_timeout"):
        assert name in rows  # the ones issue 51 found missing from the hand-kept tables
    assert "XDG_CACHE_HOME" in rows["cache_dir"] and "10^9" in rows["cache_limit"]


def test_every_stats_key_has_a_row_with_its_unit_and_no_row_is_stale(tmp_path) -> None:
    """The keys of a live ``stats()`` (an epoch read to its end) against docs/reference_tables.STATS."""
    from asyncload import DeepLakeSource, make_dataset

    url = str(tmp_path / "seg")
    make_dataset(url, 8, height=16, width=16, progress=False)
    with AsyncLoader(DeepLakeSource(url), 4, processes=0) as loader:
        for _ in loader:
            pass
        keys = set(loader.stats())
    documented = set(reference_tables().STATS)
    assert not keys - documented, f"stats() keys without a row (unit, meaning) in docs/reference_tables.py: {sorted(keys - documented)}"  # fmt: skip
    assert not documented - keys, f"rows of keys stats() no longer has: {sorted(documented - keys)}"
    assert all(unit for unit, _ in reference_tables().STATS.values())


def test_every_slowest_rank_key_has_a_row() -> None:
    """The keys rank 0 of a process group adds (``engine.slowest.slowest``) against RANK_STATS."""
    from asyncload.engine.slowest import slowest

    post = {"rank": 0, "elapsed_s": 1.0, "steady_wait_s": 0.1, "consumer_wait_frac": 0.1, "waiting_on": "store"}
    assert set(slowest([post], [])) == set(reference_tables().RANK_STATS)
    assert set(slowest([], [1])) <= set(reference_tables().RANK_STATS)


def test_every_environment_variable_the_package_reads_has_a_row() -> None:
    """A name read by ``os.environ.get("X")``, ``env.get("X")``, ``environ["X"]``, ``pick(..., "X")``
    or listed as a variable tuple anywhere in asyncload/ must be in docs/reference_tables.ENVIRONMENT."""
    read: set[str] = set()
    for path in (ROOT / "asyncload").rglob("*.py"):
        code = path.read_text()
        read |= set(re.findall(r"\b(?:environ|env)(?:\.get\(|\[)\s*\"([A-Z][A-Z0-9_]+)\"", code))
        read |= set(re.findall(r"\"([A-Z][A-Z0-9_]+)\" in os\.environ", code))
        for args in re.findall(r"\bpick\(([^)]*)\)", code):
            read |= set(re.findall(r"\"([A-Z][A-Z0-9_]{2,})\"", args))
        for names in re.findall(r"^_[A-Z_]+ = \(((?:\"[A-Z][A-Z0-9_]+\",? ?)+)\)", code, re.M):
            read |= set(re.findall(r"\"([A-Z][A-Z0-9_]+)\"", names))
    assert {"ASYNCLOAD_CACHE_DIR", "XDG_CACHE_HOME", "AWS_ENDPOINT_URL", "OPENBLAS_NUM_THREADS"} <= read  # found
    missing = read - set(reference_tables().ENVIRONMENT)
    assert not missing, f"environment variables read by asyncload without a row in docs/reference_tables.py: {sorted(missing)}"  # fmt: skip


def test_the_support_matrix_is_the_one_pyproject_declares() -> None:
    md = reference_tables().support_md()
    project = (ROOT / "pyproject.toml").read_text()
    python = re.search(r'^requires-python = "([^"]+)"', project, re.M)
    deeplake = re.search(r'"deeplake([^";]+)"', project)
    torch_ = re.search(r'"torch([<>=!][^";]+)"', project)
    assert python and deeplake and torch_
    for spec in (python.group(1), deeplake.group(1), torch_.group(1)):
        assert spec in md, spec
    assert "torchvision" in md and "`[gpu]` extra" in md and re.search(r'^gpu = \["torchvision"\]', project, re.M)


def test_normalize_with_a_transform_names_only_the_settings_given() -> None:
    with pytest.raises(ConfigError) as e:
        LoaderOptions(normalize=((0.5,) * 3, (0.5,) * 3), transform=lambda s: s)
    assert str(e.value).startswith("normalize=((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)) is not allowed with a transform")
    assert "layout" not in str(e.value) and "dtype" not in str(e.value)
    with pytest.raises(ConfigError, match=r"^layout='NCHW' is not allowed with a collate_fn|^layout='NCHW' is not"):
        LoaderOptions(layout="NCHW", collate_fn=list)


def test_a_warning_for_forked_workers_is_said_once_across_the_forks() -> None:
    """``log_once_forked``, which the forked-DataLoader-worker warning uses: four children forked at once,
    then four more (a second epoch's workers), one grandchild: one line in all."""
    code = """
import logging, os, sys
logging.basicConfig(stream=sys.stderr, format="%(message)s")
from asyncload.runtime.log import log_once_forked
def child():
    log_once_forked("fork s3://b/seg", f"forked {os.getpid()}")
    if os.fork() == 0:
        log_once_forked("fork s3://b/seg", "grandchild")
        os._exit(0)
    os.wait()
for epoch in range(2):
    pids = []
    for _ in range(4):
        pid = os.fork()
        if pid == 0:
            child(); os._exit(0)
        pids.append(pid)
    for p in pids:
        os.waitpid(p, 0)
log_once_forked("fork s3://other", "another key is its own")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len([ln for ln in lines if ln.startswith(("forked", "grandchild"))]) == 1, lines
    assert "another key is its own" in lines


def test_the_committed_reference_tables_are_fresh() -> None:
    """``docs/reference.md`` includes tables generated from the code; they are committed, so that the page
    reads on GitHub too, and must equal what the code renders now (regenerated == committed)."""
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import reference_tables
    finally:
        sys.path.remove(str(ROOT / "docs"))
    folder = ROOT / "docs" / "reference" / "generated"
    stale = [
        name for name, render in reference_tables.TABLES.items() if (folder / f"{name}.md").read_text() != render()
    ]
    assert not stale, f"stale tables in docs/reference/generated/: {stale}; run python docs/reference_tables.py --write"
    tracked = subprocess.run(["git", "ls-files", "docs/reference/generated"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0:  # (a copy without git: the contents are what matters)
        assert sorted(tracked.stdout.split()) == sorted(
            f"docs/reference/generated/{n}.md" for n in reference_tables.TABLES
        )
