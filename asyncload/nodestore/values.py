"""A row's value as bytes on disk and back, exactly; and why a pickled one can be trusted.

Bytes, text, arrays of any non-object dtype (structured, datetime, 0-d) and numpy scalars are written as
their raw bytes and rebuilt with their type, dtype and shape: reading them back runs no code whatever the
bytes are. Anything else (Python values, ragged lists, JSON objects) is pickled, and unpickling runs code:
such a value is written with an HMAC-SHA256 of its bytes under a key of the user's (``user_key``), and is
unpickled only where the MAC matches. The key lives outside the store's root (in the user's config
directory, 0600), so a user who can read or even write the store cannot make a value that passes. Pickled
values were kept rather than read through because a segmentation set's JSON and list columns are small and
read every epoch; the MAC costs ~1 µs per KB of them, and nothing for arrays and bytes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import pickle
import stat
from pathlib import Path
from typing import Any

import numpy as np

from ..runtime.log import log_once

#: Bytes of the user's key.
KEY_BYTES = 32


class Unkeepable(Exception):
    """A value the store cannot give back exactly (it cannot be pickled, or no key can authenticate it): its
    column is read through."""


class Forged(Exception):
    """A stored value that does not decode as written (its MAC or its type description is wrong): the part is
    treated as corrupt and fetched again."""


def key_path() -> Path:
    """Where the user's key lives: ``$XDG_CONFIG_HOME/asyncload/store.key`` (else ``~/.config/...``)."""
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".config") / "asyncload" / "store.key"


_keys: dict[tuple[int, str], bytes | None] = {}
_fast: dict[tuple[int, str | None, str | None], bytes | None] = {}


def user_key() -> bytes | None:
    """This user's key, made on first use (0600, created whole or not at all: written under a temporary name
    and linked into place, so a second process reads either none or all of it); None, said once, where it
    cannot be made or read, or is not private (another owner, readable by others)."""
    fast = (os.getuid(), os.environ.get("XDG_CONFIG_HOME"), os.path.expanduser("~"))  # (per value: no Path built)
    if fast in _fast:
        return _fast[fast]
    path = key_path()
    slot = (os.getuid(), str(path))
    if slot not in _keys:
        try:
            _keys[slot] = _read_key(path) or _make_key(path)
        except OSError as exc:
            _keys[slot] = None
            log_once(
                f"asyncload: the node block store's key {path} cannot be used ({exc.strerror or exc}): values "
                f"that need pickle are read through, not kept; remove it (a new one is made) or set "
                f"XDG_CONFIG_HOME to a private directory",
                logging.WARNING,
            )
    _fast[fast] = _keys[slot]
    return _keys[slot]


def _read_key(path: Path) -> bytes | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise OSError(errno.EACCES, f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}, not 0600")
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise OSError(errno.EINVAL, f"{len(key)} bytes, not {KEY_BYTES}")
    return key


def _make_key(path: Path) -> bytes:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, os.urandom(KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # (fails where another process made it first: its key is the key)
    except FileExistsError:
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    key = _read_key(path)
    assert key is not None
    return key


def _mac(key: bytes, data: bytes | bytearray | memoryview | np.ndarray) -> str:
    return hmac.new(key, data, hashlib.sha256).hexdigest()


def encode(value: Any) -> tuple[bytes | memoryview, str]:
    """A row's value as bytes, and how to rebuild it exactly (type, dtype, shape; for a pickle, its MAC)."""
    if type(value) is bytes:
        return value, "b"
    if type(value) is str:
        return value.encode("utf-8", "surrogatepass"), "s"
    if isinstance(value, memoryview):  # a reader process's answer: bytes to every reader of a batch
        return value.cast("B"), "b"
    if type(value) is np.ndarray and not value.dtype.hasobject:
        flat = np.ascontiguousarray(value).reshape(-1).view(np.uint8)  # (a view: datetime and structured too)
        return memoryview(flat), "a" + json.dumps([np.lib.format.dtype_to_descr(value.dtype), value.shape])
    if isinstance(value, np.generic) and not value.dtype.hasobject:
        return np.asarray(value).reshape(-1).view(np.uint8).tobytes(), "n" + json.dumps(
            np.lib.format.dtype_to_descr(value.dtype)
        )
    try:
        data = pickle.dumps(value, protocol=5)
    except Exception as exc:  # noqa: BLE001 - any failure of any value's pickling
        raise Unkeepable(f"a {type(value).__module__}.{type(value).__qualname__} cannot be pickled ({exc})") from None
    key = user_key()
    if key is None:
        raise Unkeepable(f"a {type(value).__module__}.{type(value).__qualname__} needs pickle, and no key is usable")
    return data, "p" + _mac(key, data)


def decode(buf: bytes | bytearray | np.ndarray, how: str) -> Any:
    """The value ``encode`` wrote as ``buf``; ``Forged`` where it cannot be (a pickle whose MAC does not
    match this user's key is never unpickled; a type description that asks for Python objects)."""
    kind = how[:1]
    if kind == "b":
        return bytes(buf)
    if kind == "s":
        return bytes(buf).decode("utf-8", "surrogatepass")
    try:
        if kind == "a":
            descr, shape = json.loads(how[1:])
            return np.frombuffer(buf, _dtype(descr)).reshape(shape)
        if kind == "n":
            return np.frombuffer(buf, _dtype(json.loads(how[1:])))[0]
    except (ValueError, TypeError, IndexError) as exc:
        raise Forged(f"a value that does not rebuild ({exc})") from None
    key = user_key()
    if kind != "p" or key is None or not hmac.compare_digest(_mac(key, buf), how[1:]):
        raise Forged("a pickled value without this user's MAC")
    return pickle.loads(buf)


def _dtype(descr: Any) -> np.dtype[Any]:
    dtype = np.lib.format.descr_to_dtype(_tuples(descr))
    if dtype.hasobject:
        raise ValueError("an object dtype")
    return dtype


def _tuples(descr: Any) -> Any:
    """A dtype description read back from JSON (lists where numpy wrote tuples)."""
    if isinstance(descr, list):
        return [tuple(_tuples(x) if isinstance(x, list) else x for x in field) for field in descr]
    return descr


__all__ = ["Forged", "Unkeepable", "decode", "encode", "key_path", "user_key"]
