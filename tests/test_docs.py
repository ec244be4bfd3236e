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


def test_the_readme_installs_this_project_and_says_how_long_make_test_takes() -> None:
    assert "pip install torch-asyncload" in README and "pip install asyncload " not in README
    assert 'name = "torch-asyncload"' in (ROOT / "pyproject.toml").read_text()
    assert re.search(r"`make test`[^.]*minutes on 2 cores", README)


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
