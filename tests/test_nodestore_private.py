"""The node store is private: another local user cannot make it run code, serve a value of theirs, or write a
file of the user's (``nodestore.root``, ``nodestore.values``).

Played with two real uids (``setpriv``), each step a fresh interpreter that imports only the store: a
victim (``VICTIM``) whose store was left open to others, and an attacker (``nobody``). Needs root to take
the two uids; skipped with the reason elsewhere."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VICTIM = 4242
ATTACKER = 65534  # nobody

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(os.geteuid() != 0, reason="playing a second user needs root (setpriv to two uids)"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (util-linux) is not installed"),
]


@pytest.fixture
def base() -> Iterator[Path]:
    """A directory both users can reach (pytest's own is root's, 0700), removed after."""
    d = Path(tempfile.mkdtemp(prefix="asyncload-private-", dir="/var/tmp"))
    d.chmod(0o755)
    home = d / "victim"
    home.mkdir()
    os.chown(home, VICTIM, VICTIM)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def as_user(uid: int, code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``code`` run by ``uid`` (its own group, no others) in a new interpreter; the store's log to stderr."""
    prelude = (
        f"import sys, logging; sys.path.insert(0, {str(ROOT)!r}); "
        "logging.basicConfig(level=logging.INFO, format='%(message)s', stream=sys.stderr)\n"
    )
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG")}
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", prelude + code],
        env={**keep, "HOME": "/nonexistent", **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def victim(base: Path, code: str, **env: str) -> tuple[dict, str]:
    """The victim's step: its answer (the last line of stdout, JSON) and its log."""
    out = as_user(VICTIM, code, XDG_CONFIG_HOME=str(base / "victim" / "config"), **env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


WRITE = """
import json, os
from pathlib import Path
from asyncload.nodestore import NodeStore
os.umask(0)  # (a umask 000 job)
store = NodeStore(Path({root!r}), None)
shelf = store.shelf("ds|v1", "ds")
ok = shelf.put([0, 1, 2, 3], {{"meta@a": [{{"row": i}} for i in range(4)], "img@b": [bytes([i]) * 100 for i in range(4)]}})
store.close()
print(json.dumps(ok))
"""

READ = """
import json
from pathlib import Path
from asyncload.nodestore import CorruptPart, NodeStore
store = NodeStore(Path({root!r}), None)
shelf = store.shelf("ds|v1", "ds")

def read():  # as the read stage does: a part that fails its check is dropped (and would be fetched again)
    out = {{}}
    for r, e in shelf.lookup([0, 1, 2, 3], ["meta@a", "img@b"]).items():
        try:
            out[r] = shelf.get([e["meta@a"], e["img@b"]])
        except CorruptPart as bad:
            shelf.forget(bad.part)
    return {{r: [v[0], v[1].hex()] for r, v in out.items()}}

served = read()
shelf.put([0, 1, 2, 3], {{"meta@a": [{{"row": i}} for i in range(4)], "img@b": [bytes([i]) * 100 for i in range(4)]}})
back = read()
store.close()
print(json.dumps({{"served": served, "back": back}}))
"""

EXPECTED = {str(i): [{"row": i}, (bytes([i]) * 100).hex()] for i in range(4)}


class Payload:
    """What the attacker pickles: unpickling it creates ``marker`` (any code would run the same way)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (open, (self.marker, "w"))


def left_open(root: Path) -> None:
    """The store as a umask 000 job or an older asyncload left it: every directory open to all."""
    for d in [root, *(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        d.chmod(0o777)


def test_an_attackers_index_and_parts_in_a_root_left_open_never_run_nor_serve(base: Path) -> None:
    root = base / "cache"
    root.mkdir()
    os.chown(root, VICTIM, VICTIM)
    ok, _ = victim(base, WRITE.format(root=str(root)))
    assert ok is True
    left_open(root)
    marker = base / "victim" / "ran"
    evil = pickle.dumps(Payload(str(marker)))
    fake = base / "attacker"
    # The attacker: a copy of the readable index whose entries point at its own part, pickled, CRC matching
    # (and a MAC it has to guess), renamed into place with its own parts/, the victim's log and files gone.
    attack = f"""
import os, shutil, sqlite3
root, fake = {str(root)!r}, {str(fake)!r}
os.makedirs(fake + "/parts/0")
shutil.copy(root + "/index.sqlite3", fake + "/index.sqlite3")
evil = {evil!r}
with open(fake + "/parts/0/999.rows", "wb") as f:
    f.write(evil)
db = sqlite3.connect(fake + "/index.sqlite3")
db.execute("INSERT INTO parts VALUES (999, 1, 4096, 'x', 1)")
db.execute("UPDATE entries SET part = 999, off = 0, len = ?, crc = ?, how = ?", (len(evil), {zlib.crc32(evil)}, "p" + "0" * 64))
db.commit(); db.close()
for name in ("index.sqlite3-wal", "index.sqlite3-shm"):
    if os.path.exists(root + "/" + name):
        os.unlink(root + "/" + name)
os.rename(root + "/parts", root + "/old-parts")
os.rename(fake + "/parts", root + "/parts")
os.rename(fake + "/index.sqlite3", root + "/index.sqlite3")
print("planted")
"""
    fake.mkdir()
    os.chown(fake, ATTACKER, ATTACKER)
    out = as_user(ATTACKER, attack)
    assert out.stdout.strip() == "planted", out.stderr[-2000:]
    assert root.joinpath("index.sqlite3").stat().st_uid == ATTACKER
    got, said = victim(base, READ.format(root=str(root)))
    assert not marker.exists()  # no code ran
    assert got == {"served": {}, "back": EXPECTED}  # nothing of the attacker's served; its own rows kept again
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == VICTIM
    assert "was mode 0777: made private (0700)" in said
    lines = [x for x in said.splitlines() if "index at" in x]
    assert len(lines) == 1 and "index.sqlite3 is not a private file of this user's (uid 65534" in lines[0], said
    assert "a new index started" in lines[0]
    assert not any(p.stat(follow_symlinks=False).st_uid == ATTACKER for p in root.glob("parts/**/*"))


def test_a_pickle_without_the_users_mac_is_never_unpickled(base: Path) -> None:
    """The second wall, alone: a stored pickle whose MAC was not made with the victim's key (here the right
    bytes, CRC and all, written through the victim's own index) is a corrupt part, dropped, never run."""
    root = base / "victim" / "cache"
    ok, _ = victim(base, WRITE.format(root=str(root)))
    assert ok is True
    marker = base / "victim" / "ran"
    evil = pickle.dumps(Payload(str(marker)))
    part = next(root.glob("parts/*/*.rows"))
    with part.open("ab") as f:
        f.write(evil)
    size = part.stat().st_size
    with sqlite3.connect(root / "index.sqlite3") as db:
        db.execute(
            "UPDATE entries SET off = ?, len = ?, crc = ?, how = ? WHERE col = 'meta@a'",
            (size - len(evil), len(evil), zlib.crc32(evil), "p" + "ab" * 32),
        )
    for p in [root, *root.rglob("*")]:
        os.chown(p, VICTIM, VICTIM, follow_symlinks=False)
    got, _ = victim(base, READ.format(root=str(root)))
    assert not marker.exists()
    assert got == {"served": {}, "back": EXPECTED}


def test_a_fallback_directory_another_user_made_first_is_refused(base: Path) -> None:
    tmp = base / "tmp"
    tmp.mkdir(mode=0o777)
    tmp.chmod(0o1777)
    taken = tmp / f"asyncload-{VICTIM}"
    out = as_user(ATTACKER, f"import os; os.mkdir({str(taken)!r}, 0o777); os.chmod({str(taken)!r}, 0o777)")
    assert out.returncode == 0, out.stderr
    code = """
import json
from asyncload.nodestore import open_shelf
print(json.dumps(open_shelf("ds|v1", "ds", None, None) is None))
"""
    env = {"TMPDIR": str(tmp), "XDG_CACHE_HOME": "/dev/shm/asyncload-test-not-local"}
    off, said = victim(base, code, **env)
    assert off is True
    assert (
        f"the node block store is off: {taken} is not private: owned by uid 65534 (nobody), mode 0777; another user "
        f"made it first: it is not used (a directory owned by uid {VICTIM}, mode 0700: set cache_dir or "
        f"ASYNCLOAD_CACHE_DIR to one" in said
    ), said
    assert os.listdir(taken) == []  # nothing of the victim's went into it
    # A link to a directory of the victim's own, planted under the name: refused too, nothing written there.
    taken.rmdir()
    mine = base / "victim" / "elsewhere"
    mine.mkdir()
    os.chown(mine, VICTIM, VICTIM)
    out = as_user(ATTACKER, f"import os; os.symlink({str(mine)!r}, {str(taken)!r})")
    assert out.returncode == 0, out.stderr
    off, said = victim(base, code, **env)
    assert off is True and f"{taken} is not private" in said and os.listdir(mine) == []


def test_links_planted_in_a_root_left_open_never_write_a_file_of_the_users(base: Path) -> None:
    root = base / "cache"
    root.mkdir()
    os.chown(root, VICTIM, VICTIM)
    ok, _ = victim(base, WRITE.format(root=str(root)))
    assert ok is True
    for p in root.glob("parts/*/*.rows"):
        p.unlink()  # (an empty store with its index: the next part ids are known)
    with sqlite3.connect(root / "index.sqlite3") as db:
        db.execute("DELETE FROM entries")
        db.execute("DELETE FROM parts")
        db.execute("UPDATE meta SET v = 0 WHERE k = 'used'")
        (nxt,) = db.execute("SELECT seq + 1 FROM sqlite_sequence WHERE name = 'parts'").fetchone()
    for p in [root, *root.rglob("*")]:
        os.chown(p, VICTIM, VICTIM, follow_symlinks=False)
    left_open(root)
    precious = base / "victim" / "precious"
    precious.write_text("the user's own")
    os.chown(precious, VICTIM, VICTIM)
    docs = base / "victim" / "docs"
    docs.mkdir()
    os.chown(docs, VICTIM, VICTIM)
    plant = f"""
import os
root = {str(root)!r}
os.symlink({str(precious)!r}, root + "/parts/0/{nxt}.rows")
os.symlink({str(docs)!r}, root + "/parts/1")
os.symlink({str(precious)!r}, root + "/in-use/1")
print("planted")
"""
    out = as_user(ATTACKER, plant)
    assert out.stdout.strip() == "planted", out.stderr[-2000:]
    got, _ = victim(base, READ.format(root=str(root)))
    assert got == {"served": {}, "back": EXPECTED}
    assert precious.read_text() == "the user's own" and os.listdir(docs) == []
    assert not any(p.is_symlink() for p in root.rglob("*"))


def test_a_cache_dir_that_is_another_users_link_is_not_followed(base: Path) -> None:
    """``cache_dir=/tmp/mystore`` where another user made that name first, as a link to a directory of the
    victim's: refused, nothing written there."""
    mine = base / "victim" / "dotfiles"
    mine.mkdir()
    os.chown(mine, VICTIM, VICTIM)
    tmp = base / "tmp"
    tmp.mkdir()
    tmp.chmod(0o1777)  # (a shared /tmp)
    link = tmp / "mystore"
    out = as_user(ATTACKER, f"import os; os.symlink({str(mine)!r}, {str(link)!r})")
    assert out.returncode == 0, out.stderr
    code = f"""
import json
from asyncload.nodestore import open_shelf
print(json.dumps(open_shelf("ds|v1", "ds", {str(link)!r}, None) is None))
"""
    off, said = victim(base, code)
    assert off is True and os.listdir(mine) == []
    assert f"{link} is not private: owned by uid 65534 (nobody), mode 0777; a link another user made" in said
