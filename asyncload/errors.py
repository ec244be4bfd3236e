"""Exceptions that name what went wrong: the source, the column, the indices, the setting.

Two rules shape this module:
- every error a user sees says *which* thing is wrong (URL, column, indices), never a secret;
- a failed read keeps a meaningful type. ``await`` on a Deep Lake future turns every error into
  ``RuntimeError``; asyncload recovers the original type where it can and raises a ``ReadError`` that is
  *also* an instance of that type, so both ``except asyncload.ReadError`` and ``except IndexError``
  work.
- every error crosses a process boundary intact. DataLoader workers, fan-out processes and spawn send
  exceptions (or their classes) by pickle; an exception that does not pickle is dropped by DataLoader's
  feeder thread and the epoch ends short without a word. So the typed classes are importable by name,
  ``__cause__`` travels with the error, and ``portable`` turns anything else into a ``RemoteError``.
"""

from __future__ import annotations

import builtins
import pickle
import traceback
from collections.abc import Callable, Sequence
from typing import Any


class AsyncLoadError(Exception):
    """Base class of asyncload's own errors."""

    def __str__(self) -> str:  # KeyError subclasses would otherwise quote the message
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException's own reduce drops __cause__; the cause is often the only account of *why*.
        cause = self.__cause__
        return _rebuild, (type(self), self.args, self.__dict__, portable(cause) if cause is not None else None)


def _rebuild(
    cls: type[AsyncLoadError], args: tuple[Any, ...], state: dict[str, Any], cause: BaseException | None
) -> AsyncLoadError:
    exc = cls.__new__(cls, *args)
    exc.args = args
    exc.__dict__.update(state)
    if cause is not None:
        exc.__cause__ = cause
    return exc


class RemoteError(AsyncLoadError):
    """An exception that could not cross a process boundary as itself (its class or arguments do not
    pickle). The message keeps its type name and text; a note keeps its traceback."""


def portable(exc: BaseException) -> BaseException:
    """``exc`` when it survives a pickle round trip with its type, else a ``RemoteError`` telling it.

    Called where an exception is about to leave its process (a DataLoader worker, a fan-out worker), so
    that no error is ever lost to a pickling failure on the way.
    """
    try:
        back = pickle.loads(pickle.dumps(exc))
        if type(back) is type(exc):
            return exc
    except Exception:  # noqa: BLE001 - any failure means it cannot travel as itself
        pass
    kind = type(exc)
    err = RemoteError(f"{kind.__module__}.{kind.__qualname__}: {exc}")
    err.add_note("".join(traceback.format_exception(exc)).rstrip())
    return err


def pack(exc: BaseException) -> tuple[bytes, str, str, str]:
    """``exc`` as plain data that always crosses a process boundary: its pickle (``portable``), its type
    name, its text and its traceback. See ``unpack``."""
    kind = type(exc)
    return (
        pickle.dumps(portable(exc)), f"{kind.__module__}.{kind.__qualname__}", str(exc),
        "".join(traceback.format_exception(exc)),
    )  # fmt: skip


def unpack(pickled: bytes, type_name: str, message: str) -> BaseException:
    """The exception ``pack`` made, or a ``RemoteError`` telling its type and text when this process
    cannot unpickle it (a class only the sender could import)."""
    try:
        exc = pickle.loads(pickled)
    except Exception:  # noqa: BLE001 - any failure: say what it was instead
        exc = None
    return exc if isinstance(exc, BaseException) else RemoteError(f"{type_name}: {message}")


class ConfigError(AsyncLoadError, ValueError):
    """An impossible or unknown setting; the message names the setting, the value and what is allowed."""


class RanksDisagreeError(ConfigError):
    """The ranks of a ``torch.distributed`` process group would read different data: their sources'
    versions (a Deep Lake commit and, for a query, a digest of its rows in order; an object store's keys)
    differ. Typically a ``SAMPLE BY`` query, or one whose order it leaves open, that each rank ran on its
    own. ``versions`` maps each rank to what it opened."""


class SourceError(AsyncLoadError):
    """A source could not be opened or does not have what was asked for."""


class DatasetNotFoundError(SourceError, FileNotFoundError):
    """No dataset at the given URL."""


class ColumnNotFoundError(SourceError, KeyError):
    """A requested column is not in the dataset."""


class StoreEndpointError(SourceError, ConnectionError):
    """The store's endpoint did not answer (down, refused, unreachable, too slow)."""


class StoreAccessError(SourceError, PermissionError):
    """The store refused the credentials, or denied access to the bucket or container."""


class BucketNotFoundError(DatasetNotFoundError):
    """The bucket (or container) does not exist at the endpoint."""


class S3EndpointError(StoreEndpointError):
    """The S3 endpoint did not answer (down, refused, unreachable, too slow)."""


class S3AccessError(StoreAccessError):
    """The S3 endpoint refused the credentials, or denied access to the bucket."""


class S3BucketNotFoundError(BucketNotFoundError):
    """The bucket does not exist at the endpoint."""


class CollateError(AsyncLoadError, ValueError):
    """Samples of one column cannot be stacked into a batch tensor."""


class DecodeError(ValueError):
    """Bytes that do not decode as the image they claim to be; the message is the decoder's."""


class ReadError(AsyncLoadError):
    """Reading samples failed. ``source``, ``column`` and ``indices`` say which; ``__cause__`` says why."""

    def __init__(
        self, message: str, *, source: str = "", column: str | None = None, indices: Sequence[int] = ()
    ) -> None:
        super().__init__(message)
        self.source = source
        self.column = column
        self.indices = list(indices)


class StallError(ReadError):
    """The store gave no answer for longer than ``stall_timeout``: the epoch stopped waiting. ``waited_s``
    says how long it waited; ``indices`` are the rows that were in flight."""

    def __init__(self, message: str, *, source: str = "", indices: Sequence[int] = (), waited_s: float = 0.0) -> None:
        super().__init__(message, source=source, indices=indices)
        self.waited_s = waited_s


class LoaderClosedError(AsyncLoadError):
    """``close()`` was called (from another thread) while this epoch was still being read: the epoch did
    not end, it was stopped. ``StopIteration`` only ever means that every batch of the epoch was yielded."""


class WorkerError(AsyncLoadError):
    """A worker (thread or process) of the loader died; the message names it and what it held."""


class ReaderCrashError(ReadError):
    """Reading these rows killed the process that read them, every time: the loader read them alone in a
    new reader process until the rows were found. ``signal`` names how the reader ended (``SIGSEGV``...)."""

    def __init__(self, message: str, *, source: str = "", indices: Sequence[int] = (), signal: str = "") -> None:
        super().__init__(message, source=source, indices=indices)
        self.signal = signal


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


def __getattr__(name: str) -> type[ReadError]:
    """Resolve ``ReadError[<builtin>]`` by name, which is how pickle finds the typed classes in another
    process (they are made on demand, so they are not module attributes until asked for)."""
    if name.startswith("ReadError[") and name.endswith("]"):
        cause = getattr(builtins, name[len("ReadError[") : -1], None)
        if isinstance(cause, type) and issubclass(cause, BaseException):
            typed = _typed(cause)
            if typed.__qualname__ == name:
                return typed
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _short(indices: Sequence[int], limit: int = 16) -> str:
    idx = list(indices)
    text = ", ".join(map(str, idx[:limit]))
    return f"[{text}{', ...' if len(idx) > limit else ''}] ({len(idx)} indices)" if len(idx) > limit else f"[{text}]"


#: Sources whose samples are objects a user can find (object-store files), by URL: ``(column, row)`` →
#: the object's URL. Registered by the source when it opens, in each process, and looked up here, so that
#: an error raised far from the source (the decode stage) still names the file, not only its row number.
_object_names: dict[str, Callable[[str, int], str | None]] = {}


def name_objects(source: str, namer: Callable[[str, int], str | None]) -> None:
    """Have ``read_error`` name the object of ``(column, row)`` of ``source`` (``namer`` may hold a weak
    reference and answer None once its source is gone)."""
    _object_names[source] = namer


def _object(source: str, column: str | None, indices: Sequence[int]) -> str | None:
    namer = _object_names.get(source)
    if namer is None or column is None or len(indices) != 1:
        return None
    try:
        return namer(column, int(indices[0]))
    except Exception:  # noqa: BLE001 - naming the object is a courtesy; the error itself must still come
        return None


def read_error(source: str, column: str | None, indices: Sequence[int], cause: BaseException) -> ReadError:
    """Build the ``ReadError`` for a failed read, typed after ``cause``, with ``__cause__`` set; for an
    object-store file, its URL too (``name_objects``)."""
    where = f"column {column!r} of {source}" if column else source
    obj = _object(source, column, indices)
    at = f"indices {_short(indices)}" + (f" (object {obj})" if obj and obj not in str(cause) else "")
    msg = f"reading {where} at {at} failed: {type(cause).__name__}: {cause}"
    err = _typed(type(cause))(msg, source=source, column=column, indices=indices)
    err.__cause__ = cause
    return err
