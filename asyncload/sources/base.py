"""The ``Source`` contract: what the loader needs from a store, and the per-process handle rule.

A source is a small, picklable *description* of a dataset (URL, columns, credentials). The live handle
(a Deep Lake dataset, an HTTP session) is opened lazily in the process that reads and is never carried
across a fork or a pickle: ``__getstate__`` drops it and a changed pid makes the next read reopen. This
is what lets a source be handed to DataLoader workers under fork, spawn and forkserver alike.
"""

from __future__ import annotations

import abc
import hashlib
import inspect
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar

import numpy as np

from ..runtime.loop import ExitOrder, on_exit

if TYPE_CHECKING:
    from ..image.codecs import ImageColumn

H = TypeVar("H")

#: What ``Source.read`` returns: for each column, one array per requested index, either a list or an
#: ndarray stacked on its first axis.
Columns = dict[str, "Sequence[np.ndarray] | np.ndarray"]


def _takes_raw(read: Any) -> bool:
    """Whether ``read(self, indices, raw)`` gives ``raw`` to this ``read``: its third positional parameter is
    named ``raw``, is ``*args``, or has no default (a read of the current contract that names it otherwise).
    A read written before ``raw`` existed takes ``(self, indices)`` alone, or a third parameter of its own
    with a default (it was never passed one)."""
    try:
        sig = inspect.signature(read)
    except (TypeError, ValueError):  # an odd callable: assume it follows the contract
        return True
    params = [p for p in sig.parameters.values() if p.kind not in (p.KEYWORD_ONLY, p.VAR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params[:3]):
        return True
    if len(params) < 3:
        return False
    return params[2].name == "raw" or params[2].default is inspect.Parameter.empty


def _ignoring_raw(read: Any) -> Any:
    """``read(self, indices)`` as ``read(self, indices, raw)``: ``raw`` dropped, so the source decodes every
    column itself as it did before ``raw`` existed (the decode stage takes arrays as they are)."""

    async def read_ignoring_raw(self: Source[Any], indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        return await read(self, indices)

    for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(read_ignoring_raw, attr, getattr(read, attr, None))
    read_ignoring_raw.__dict__.update(read.__dict__)  # ``__isabstractmethod__`` among them
    read_ignoring_raw.__asyncload_without_raw__ = read  # type: ignore[attr-defined]
    return read_ignoring_raw


@dataclass(frozen=True)
class Description:
    """What the loader asks of an opened source, answered by the process that opened it: a reader process
    (``processes.isolated``) sends it, so that the training process answers the loader without opening the
    store itself (``Source.adopt``). ``learned``: what the open drew that later opens must not draw again (a
    query's rows), set on the training process's copy, which every later reader is given."""

    length: int
    version: str | None
    identity: str | None
    store_key: str | None
    image_columns: Mapping[str, ImageColumn]
    read_mode: Literal["row", "column"]
    value_tags: Mapping[str, str]
    learned: Mapping[str, Any]


def _close_at_exit(ref: weakref.ref[Source[Any]]) -> None:
    """A source's stop at interpreter exit (``ExitOrder.STORES``: after every read was stopped). Garbage
    collection of the source needs nothing: its handle goes with it."""
    src = ref()
    if src is not None:
        src.close()


_CODE_TAGS: dict[type, str] = {}


def code_tag(cls: type) -> str:
    """The class's name and, where a class of its lineage is not asyncload's own (a user's subclass), a
    digest of that class's code: a subclass whose ``read`` changed writes a store of its own rather than
    being served what the old code returned."""
    tag = _CODE_TAGS.get(cls)
    if tag is None:
        h = hashlib.sha256()
        foreign = False  # asyncload's own classes: the name alone (a digest of no code is no information)
        for k in cls.__mro__:
            if k.__module__.split(".")[0] in ("asyncload", "builtins", "abc", "typing"):
                continue
            for name, fn in sorted(vars(k).items()):
                fn = getattr(fn, "__func__", fn)
                fn = getattr(fn, "__asyncload_without_raw__", fn)  # (an old ``read``, wrapped: its own code)
                code = getattr(fn, "__code__", None)
                if code is not None:
                    foreign = True
                    h.update(f"{k.__qualname__}.{name}".encode())
                    h.update(code.co_code)
                    h.update(repr(code.co_consts).encode())
        tag = _CODE_TAGS[cls] = f"{cls.__qualname__}:{h.hexdigest()[:12]}" if foreign else cls.__qualname__
    return tag


class Source(abc.ABC, Generic[H]):
    """A readable dataset. Subclasses implement ``_open``, ``_length`` and ``read``.

    A subclass written before ``read`` took ``raw`` (``async def read(self, indices)``) keeps working: its
    ``read`` is wrapped when the class is created (``__init_subclass__``, so in every process that imports
    or unpickles it) into one that takes ``raw`` and drops it; such a source decodes every column itself.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        read = cls.__dict__.get("read")
        if inspect.isfunction(read) and not _takes_raw(read):
            cls.read = _ignoring_raw(read)  # type: ignore[method-assign]

    def __init__(self, url: str, columns: Sequence[str]) -> None:
        if isinstance(columns, str):
            columns = (columns,)
        if not columns:
            raise ValueError(f"{type(self).__name__}({url!r}): columns must name at least one column")
        self.url = url
        self.columns: tuple[str, ...] = tuple(columns)
        self._handle_pid: int | None = None
        self._handle_obj: H | None = None
        self._handle_lock = threading.Lock()
        self._len: int | None = None
        self._ver: tuple[str | None] | None = None  # (version,) of this process's handle, once known
        self._ident: tuple[str | None] | None = None  # (identity,) likewise
        self._exit: weakref.finalize | None = None  # this process's stop at exit, while a handle is open

    # -- the per-process handle ------------------------------------------------------------------
    def handle(self) -> H:
        """The live handle for this process, opened (and validated) on first use."""
        if self._handle_pid != os.getpid() or self._handle_obj is None:
            with self._handle_lock:
                if self._handle_pid != os.getpid() or self._handle_obj is None:
                    self._handle_obj = None  # inherited through fork: never used here
                    obj = self._open()
                    self._handle_obj, self._handle_pid = obj, os.getpid()
                    if self._exit is not None:  # a handle of an earlier process (fork) or an earlier open
                        self._exit.detach()
                    self._exit = on_exit(self, ExitOrder.STORES, _close_at_exit, weakref.ref(self))
        return self._handle_obj

    def open(self) -> Source[H]:
        """Open and validate now (for errors at construction time rather than at first read)."""
        self.handle()
        return self

    def opened_elsewhere(self) -> bool:
        """Whether this process holds a handle that another process opened: a fork's parent's, whose store
        runtime a source that is not ``fork_safe`` cannot use here."""
        return self._handle_obj is not None and self._handle_pid != os.getpid()

    def close(self) -> None:
        """Drop this process's handle. Only call when no read is in flight (the loader ensures it)."""
        with self._handle_lock:
            if self._handle_pid == os.getpid():
                obj, self._handle_obj = self._handle_obj, None
                self._close_handle(obj)
                del obj
            if self._exit is not None:
                self._exit.detach()
                self._exit = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle_pid"] = None
        state["_handle_obj"] = None
        state["_ver"] = None  # each process names the version of what it opened itself
        state["_ident"] = None  # and its identity
        state["_exit"] = None
        del state["_handle_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._handle_lock = threading.Lock()

    # -- what the loader calls -------------------------------------------------------------------
    def __len__(self) -> int:
        if self._len is None:
            self._len = self._length(self.handle())
        return self._len

    @property
    def version(self) -> str | None:
        """What identifies the data behind the row numbers (a commit id, a digest of the keys), or None
        when the store cannot say. Part of every resume state: a state saved on one version must not
        silently resume on another of the same length. Computed once per process: resume states are
        taken after every batch (StatefulDataLoader), and a digest of a large listing is not free."""
        if self._ver is None:
            self._ver = (self._version(self.handle()),)
        return self._ver[0]

    def _version(self, handle: H) -> str | None:
        return None

    @property
    def identity(self) -> str | None:
        """What names the dataset itself, apart from its version: an id the store gives each dataset it
        creates (Deep Lake's ``ds.id``), or None where the store has none. Commit ids count from a dataset's
        start, so a dataset deleted and created again at the same URL has the old one's versions: only its
        identity tells them apart. Part of every resume state with the URL and the version. Computed once
        per process, like ``version``."""
        if self._ident is None:
            self._ident = (self._identity(self.handle()),)
        return self._ident[0]

    def _identity(self, handle: H) -> str | None:
        return None

    @property
    def local(self) -> bool:
        """Whether the rows are on this machine already (a local path): then the node block store
        (``nodestore``) has nothing to save, and ``cache="auto"`` leaves it off."""
        return False

    @property
    def store_key(self) -> str | None:
        """What names the bytes behind this source's rows (``row_ids``) on the node block store: what reads
        them (``code_tag``: the class, and the code of a user's subclass), the URL, the dataset's identity
        (a dataset created again at the URL has another) and the version, so that a changed remote, or a
        changed ``read``, is never served from an older copy. None (not kept) where the version is unknown.
        A source over part of another (a split, a query) names the whole dataset's rows, so that the parts
        share them."""
        version, identity = self.version, self.identity
        if version is None:
            return None
        return f"{code_tag(type(self))} {self.url}|{version if identity is None else f'{identity}/{version}'}"

    def value_tag(self, column: str) -> str:
        """The settings of this source that change what ``read`` decodes for ``column`` (not its stored
        bytes): part of the column's key on the node block store, so that loaders that decode alike share
        rows and others do not. "" where decoding has no settings."""
        return ""

    #: False where a forked child cannot safely use a store runtime inherited from its parent.
    fork_safe: bool = True

    #: True where a ``Description`` holds everything the loader asks of this source once open, so that a
    #: reader process's open can stand for the training process's own (``describe``, ``adopt``).
    describes: bool = False
    #: What an open sets that must travel with the source to every later process (a query's rows): the
    #: attributes ``describe`` sends and ``adopt`` takes, and no others.
    learned_at_open: tuple[str, ...] = ()

    def describe(self) -> Description:
        """What the loader asks of this source, opened now if it is not."""
        self.open()
        return Description(
            len(self), self.version, self.identity, self.store_key, dict(self.image_columns()),
            self.preferred_read_mode, {c: self.value_tag(c) for c in self.columns},
            {k: getattr(self, k) for k in self.learned_at_open},
        )  # fmt: skip

    def adopt(self, described: Description) -> None:
        """Take what another process's open of this source learnt (``describe``): its length, version and
        identity then answer here without a handle, and what the open drew goes with this source from now
        on. Anything else ``describe`` sends is the caller's to answer (``IsolatedSource``)."""
        for k, v in described.learned.items():
            if k in self.learned_at_open:
                setattr(self, k, v)
        self._len, self._ver, self._ident = described.length, (described.version,), (described.identity,)

    #: True where a failing read can crash the process that runs it (a native library's bug): with
    #: ``processes="auto"`` the loader then reads in a process of its own (``LoaderOptions.reader_processes``).
    isolate_reads: bool = False

    @property
    def opens_alike(self) -> bool:
        """Whether a process that opens this source unopened reads the same rows as this process will.
        Then a reader process (``isolated``) starts before this process opens it, so that the two opens
        overlap. False where an open draws its rows (a query, which may sample at random): the reader then
        starts from the opened source, whose pickle carries them."""
        return True

    @property
    def reader_module(self) -> str:
        """The module a reader process (``isolated``) imports while it waits for this source: the one that
        imports the native library, so that its import overlaps this process's checks."""
        return type(self).__module__

    def reader_copy(self) -> Source[H]:
        """This source as a reader process (``isolated``) is given it: a source whose open checks what the
        training process has checked already (a bucket probe, a credential chain) returns a copy that
        skips it; every other source returns itself."""
        return self

    def row_ids(self, positions: list[int]) -> list[int]:
        """The store's own row numbers of loader positions (what a batch's ``"index"`` names); a source
        over a subset or a query result maps them, every other source returns them as they are."""
        return positions

    @property
    def preferred_read_mode(self) -> Literal["row", "column"]:
        """The read mode ``read_mode="auto"`` picks: "column" (many indices per request) unless a
        source measured otherwise."""
        return "column"

    @property
    def block_rows(self) -> int:
        """Rows that cost about one read together, what ``shuffle_block="auto"`` keeps contiguous in a
        shuffled epoch: 1 (rows cost the same however they are drawn) unless the store reads ranges larger
        than a row."""
        return 1

    def image_columns(self) -> Mapping[str, ImageColumn]:
        """The requested columns that hold images or masks, with their role and, where asyncload can
        decode the stored bytes itself (JPEG, PNG), their codec. Other columns pass through the decode
        stage untouched. Called once the source is open."""
        return {}

    def configure(self, requests_in_flight: int, samples_in_flight: int | None = None) -> None:
        """Hint from the loader: how many read requests, covering how many samples, it will keep in
        flight at most (size connection and thread pools from it)."""

    #: Whether a read in flight may be cancelled (``Task.cancel``) when an epoch stops or gives up on a
    #: silent store: True for coroutines that clean up when cancelled (HTTP requests, a reader process's
    #: answer). False where cancelling hangs or breaks the store (a Deep Lake future): such reads are
    #: abandoned instead, left to end on a loop kept running for them (``runtime.loop.LoopThread.linger``).
    cancel_safe: bool = True

    def set_stall_timeout(self, seconds: float) -> None:
        """Hint from the loader: its epochs give up on a store that has not answered for ``seconds``
        (``stall_timeout``). A source that waits out outages itself (``ObjectStoreSource``'s breaker)
        bounds that wait by it."""

    def outage(self) -> str | None:
        """While the store is known to be away (its reads waiting for it), what the last attempt met, for a
        ``StallError``'s message; None otherwise, or where the source cannot tell."""
        return None

    def throttle_count(self) -> int:
        """Throttling answers (503 SlowDown, 429) seen so far in this process; the concurrency tuner
        backs off when it grows. Sources that cannot see them return 0."""
        return 0

    def retry_count(self) -> int:
        """Requests retried so far in this process (for the loader's stats)."""
        return 0

    @abc.abstractmethod
    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        """Read ``indices`` (valid, in range) on the running loop; raise ``ReadError`` on failure.

        ``raw``: the columns to return as their stored bytes (one ``bytes`` per sample), undecoded: those
        the loader's decode stage decodes itself, into the batch on its CPU pool, so the store's own
        decode would be work thrown away. The pipeline passes them with each request; every other
        column, and every column of a plain ``read(indices)``, comes back decoded. A source that cannot
        return stored bytes may ignore ``raw``: the decode stage takes arrays as they are. A subclass
        that wraps ``super().read`` passes ``raw`` on.
        """

    # -- what subclasses implement ---------------------------------------------------------------
    @abc.abstractmethod
    def _open(self) -> H:
        """Open the store in this process; raise a ``SourceError`` naming what is wrong."""

    @abc.abstractmethod
    def _length(self, handle: H) -> int: ...

    def _close_handle(self, handle: H | None) -> None:
        """Release ``handle`` (default: drop the reference)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r}, columns={self.columns!r})"
