"""Exceptions that name what went wrong: the source, the column, the indices, the setting.

Two rules shape this module:
- every error a user sees says *which* thing is wrong (URL, column, indices), never a secret;
- a failed read keeps a meaningful type. ``await`` on a Deep Lake future turns every error into
  ``RuntimeError``; asyncload recovers the original type where it can and raises a ``ReadError`` that is
  *also* an instance of that type, so both ``except asyncload.ReadError`` and ``except IndexError``
  work.
"""

from __future__ import annotations

import builtins
from collections.abc import Sequence


class AsyncLoadError(Exception):
    """Base class of asyncload's own errors."""

    def __str__(self) -> str:  # KeyError subclasses would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class ConfigError(AsyncLoadError, ValueError):
    """An impossible or unknown setting; the message names the setting, the value and what is allowed."""


class SourceError(AsyncLoadError):
    """A source could not be opened or does not have what was asked for."""


class DatasetNotFoundError(SourceError, FileNotFoundError):
    """No dataset at the given URL."""


class ColumnNotFoundError(SourceError, KeyError):
    """A requested column is not in the dataset."""


class ReadError(AsyncLoadError):
    """Reading samples failed. ``source``, ``column`` and ``indices`` say which; ``__cause__`` says why."""

    def __init__(self, message: str, *, source: str = "", column: str | None = None, indices: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.source = source
        self.column = column
        self.indices = list(indices)


class WorkerError(AsyncLoadError):
    """A worker (thread or process) of the loader died; the message names it and what it held."""


_typed_cache: dict[type[BaseException], type[ReadError]] = {}


def _typed(cause: type[BaseException]) -> type[ReadError]:
    """A ``ReadError`` subclass that is also ``cause`` (for built-in exception types only); cached."""
    if cause not in _typed_cache:
        _typed_cache[cause] = _make_typed(cause)
    return _typed_cache[cause]


def _make_typed(cause: type[BaseException]) -> type[ReadError]:
    if cause.__module__ != "builtins" or not issubclass(cause, Exception) or issubclass(cause, AsyncLoadError):
        return ReadError
    if getattr(builtins, cause.__name__, None) is not cause:
        return ReadError
    try:
        return type(f"ReadError[{cause.__name__}]", (ReadError, cause), {"__module__": __name__})
    except TypeError:  # incompatible layout: keep the plain type
        return ReadError


def _short(indices: Sequence[int], limit: int = 16) -> str:
    idx = list(indices)
    text = ", ".join(map(str, idx[:limit]))
    return f"[{text}{', ...' if len(idx) > limit else ''}] ({len(idx)} indices)" if len(idx) > limit else f"[{text}]"


def read_error(source: str, column: str | None, indices: Sequence[int], cause: BaseException) -> ReadError:
    """Build the ``ReadError`` for a failed read, typed after ``cause``, with ``__cause__`` set."""
    where = f"column {column!r} of {source}" if column else source
    msg = f"reading {where} at indices {_short(indices)} failed: {type(cause).__name__}: {cause}"
    err = _typed(type(cause))(msg, source=source, column=column, indices=indices)
    err.__cause__ = cause
    return err
