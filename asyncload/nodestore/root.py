"""Where the store lives, and the one check that lets it trust what it reads there: the root is this user's.

Why: the store gives back what it finds on disk, and some of it is unpickled. A directory that another local
user can write (a group scratch folder, a ``umask 000`` job, a name another user created first in a shared
``/tmp``) lets that user choose what is read. So the root is a directory owned by the user that no one else
can enter (0700, made so where the user owns it, refused where not), and it is opened once and held as a
file descriptor: every file and directory below it is opened relative to that descriptor, one name at a
time, never through a symbolic link (``O_NOFOLLOW``), and checked on the descriptor it opened (``fstat``),
so that a rename or a link planted after a check gains nothing. Inside a private root only the user (and the
superuser) can create, rename or change anything: what was planted before the root became private is found
at open (``check_file``, the sweep of ``parts/``) and set aside.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import pwd
import shutil
import stat
import time
from pathlib import Path

from ..runtime.log import log_once

log = logging.getLogger("asyncload")

#: File systems the store is not put on unless asked (``cache_dir``, ``$ASYNCLOAD_CACHE_DIR``): network
#: ones, where SQLite's locks and ``flock`` are emulated or missing and free space ignores quotas, and
#: memory-backed ones, where the store would take the RAM that training needs.
NOT_LOCAL = ("nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "beegfs",
             "fuse.", "9p", "afs", "panfs", "wekafs", "tmpfs", "ramfs")  # fmt: skip

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class NotPrivate(PermissionError):
    """A directory or file of the store that another user owns or can write: never read, its message one
    line naming the path, owner, mode and what to set."""


# -- where the store lives -------------------------------------------------------------------------------
def fs_type(path: Path) -> str:
    """The type of the file system ``path`` is on (the longest mount point above it), "" where unknown."""
    best, kind = "", ""
    p = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            f = line.split()
            if len(f) >= 3:
                mnt = f[1].replace("\\040", " ")
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, f[2]
    return kind


def _local(path: Path) -> bool:
    kind = fs_type(_existing(path))
    return not any(kind == t or (t.endswith(".") and kind.startswith(t)) for t in NOT_LOCAL)


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def candidates() -> list[Path]:
    """Where the store may live by default, in order: ``$XDG_CACHE_HOME`` (else ``~/.cache``), then
    ``$TMPDIR`` (on clusters the job's node-local scratch), then ``/var/tmp``; each under
    ``asyncload-<uid>/blocks`` for the last two (shared directories: see ``_shared_parent``)."""
    xdg = os.environ.get("XDG_CACHE_HOME")
    home = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    out = [home / "asyncload" / "blocks"]
    for scratch in (os.environ.get("TMPDIR"), "/var/tmp"):
        if scratch:
            out.append(Path(scratch) / f"asyncload-{os.getuid()}" / "blocks")
    return out


def default_root() -> Path | None:
    """Where the store lives unless ``cache_dir`` says: ``$ASYNCLOAD_CACHE_DIR`` where set, else the first of
    ``candidates()`` on a local, disk-backed file system; None (the store off, one line saying what to
    set) where none is."""
    env = os.environ.get("ASYNCLOAD_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    found = candidates()
    for c in found:
        if _local(c):
            return c
    log_once(
        "asyncload: the node block store is off: none of "
        + ", ".join(f"{c} ({fs_type(_existing(c)) or '?'})" for c in found)
        + " is on a local disk; set cache_dir (or ASYNCLOAD_CACHE_DIR) to node-local scratch to keep blocks",
        logging.WARNING,
    )
    return None


# -- who owns it -----------------------------------------------------------------------------------------
def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def not_private(path: Path | str, st: os.stat_result, what: str) -> NotPrivate:
    """The one line that refuses ``path``: its owner and mode, and what to set."""
    me = os.getuid()
    return NotPrivate(
        errno.EACCES,
        f"{path} is not private: owned by {_user(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o}; {what} "
        f"(a directory owned by {_user(me)}, mode 0700: set cache_dir or ASYNCLOAD_CACHE_DIR to one, or "
        f"`chown {me} {path} && chmod 700 {path}`)",
    )


def _mine(st: os.stat_result) -> bool:
    return st.st_uid == os.getuid()


def private_file(st: os.stat_result) -> bool:
    """Whether a file of the store may be read: a plain file of the user's that no one else can write."""
    return stat.S_ISREG(st.st_mode) and _mine(st) and not st.st_mode & 0o022


def _make_private(fd: int, path: Path | str, st: os.stat_result) -> None:
    """A directory of the user's that others can enter: 0700 (logged once, the store's own dirs are made so)."""
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.fchmod(fd, 0o700)
        log_once(
            f"asyncload: the node block store's directory {path} was mode {stat.S_IMODE(st.st_mode):04o}: made "
            "private (0700), as the store reads back only what this user wrote",
            logging.INFO,
        )


def _open_dir(name: str | Path, dir_fd: int | None, *, follow: bool) -> int:
    return os.open(name, _DIR | (0 if follow else os.O_NOFOLLOW), dir_fd=dir_fd)


def _shared_parent(path: Path) -> Path | None:
    """``<tmp>/asyncload-<uid>`` where ``path`` is a default root under a shared directory (``candidates``):
    a name any user can create first, so it is made with ``mkdir`` and then checked without following a
    link."""
    parent = path.parent
    return parent if parent.name == f"asyncload-{os.getuid()}" else None


def open_root(path: Path) -> int:
    """A descriptor of the directory ``path``, created where missing, checked to be the user's and made
    private (``NotPrivate`` where another user owns it). Under a shared temporary directory the
    ``asyncload-<uid>`` folder is created 0700 and must be a real directory of the user's: one that another
    user created first (or a link to one) is refused."""
    shared = _shared_parent(path)
    if shared is None:
        try:
            fd = _open_dir(path, None, follow=False)
        except FileNotFoundError:
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = _open_dir(path, None, follow=False)
        except OSError as exc:  # a link: followed where the user (or the system) made it, who alone can change it
            link = os.lstat(path)
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not stat.S_ISLNK(link.st_mode):
                raise
            if link.st_uid not in (os.getuid(), 0):
                raise not_private(path, link, "a link another user made: it is not followed") from None
            fd = _open_dir(path, None, follow=True)
    else:
        shared.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(shared, 0o700)
        try:
            up = _open_dir(shared, None, follow=False)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise not_private(shared, os.lstat(shared), "another user made it first: it is not used") from None
            raise
        try:
            st = os.fstat(up)
            if not _mine(st):
                raise not_private(shared, st, "another user made it first: it is not used")
            _make_private(up, shared, st)
            fd = sub_dir(up, path.name, path)
        finally:
            os.close(up)
    try:
        st = os.fstat(fd)
        if not _mine(st):
            raise not_private(path, st, "the store reads back only what this user wrote")
        _make_private(fd, path, st)
    except BaseException:
        os.close(fd)
        raise
    return fd


def sub_dir(parent: int, name: str, shown: Path | str) -> int:
    """A descriptor of directory ``name`` below ``parent``: created 0700 where missing, opened without
    following a link, the user's and private. What is there and is not (a link, a file, another user's
    directory) is set aside (``set_aside``) and a new one made."""
    for _ in range(3):
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
        try:
            fd = _open_dir(name, parent, follow=False)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            set_aside(parent, name, shown, "not a directory")
            continue
        st = os.fstat(fd)
        if _mine(st):
            _make_private(fd, shown, st)
            return fd
        os.close(fd)
        set_aside(parent, name, shown, f"owned by {_user(st.st_uid)}")
    raise OSError(errno.EEXIST, "cannot be made a private directory", str(shown))


def set_aside(parent: int, name: str, shown: Path | str, why: str) -> None:
    """Something in the store that the user did not make (planted while the root was open to others): never
    read; removed where the user can, else renamed ``untrusted.<name>.<time>`` and left for a look. Said
    once per name."""
    aside = f"untrusted.{name}.{time.time_ns()}"
    os.rename(name, aside, src_dir_fd=parent, dst_dir_fd=parent)
    gone = True
    try:
        st = os.stat(aside, dir_fd=parent, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(aside, dir_fd=parent)
        else:
            os.unlink(aside, dir_fd=parent)
    except OSError:
        gone = False
    log_once(
        f"asyncload: the node block store found {shown} {why}, not made by this user: "
        + ("removed" if gone else f"moved aside as {aside}")
        + " and not read",
        logging.WARNING,
    )


def proc_path(fd: int, fallback: Path) -> str:
    """A path that names the directory open at ``fd`` (``/proc/self/fd/N``: the kernel's name of the very
    directory checked, not a path looked up again), for a library that takes only paths (SQLite)."""
    p = f"/proc/self/fd/{fd}"
    try:
        return os.readlink(p) if os.path.isdir(p) else str(fallback)
    except OSError:
        return str(fallback)


__all__ = [
    "NOT_LOCAL",
    "NotPrivate",
    "candidates",
    "default_root",
    "fs_type",
    "not_private",
    "open_root",
    "private_file",
    "proc_path",
    "set_aside",
    "sub_dir",
]
