"""Deep Lake datasets (local disk, memory, S3-compatible stores) read with ``get_async``.

Why it reads the way it does (Deep Lake 4.7.4; the figures are in benchmarks/results/wan/deeplake.md):
- Index lists, never slices: a slice of a compressed column decodes whole chunks.
- Reads are read-only zero-copy views: the loader copies each sample once, into its batch.
- A Deep Lake future is never awaited: its ``__await__`` races with its own completion and segfaults under
  garbage collection. Completions are polled (``runtime.polled.completion``: ``is_completed()``, then
  ``.result()``, which also keeps the error's type). Where an error still arrives as ``RuntimeError``, the
  type is read off its text (``_typed_cause``), never by reading again: each failing read can crash.
- A Deep Lake future is never cancelled (it then hangs forever) and never left unwaited: a request's
  reads are all issued, then each is waited for in turn, failures included.
- A dataset's connections are fixed when it opens: the storage pool is sized before (``_size_storage_pool``).
- Deep Lake is imported where a dataset is opened, not with this module: with a reader process (``processes``
  "auto"), the training process never imports it (the reader's ``describe`` answers for it), which saves
  that process Deep Lake's import, its open and its storage threads.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np

from ..errors import ColumnNotFoundError, ConfigError, DatasetNotFoundError, SourceError, read_error
from ..runtime.polled import completion
from .base import Columns, Source, code_tag
from .schemes import DEEPLAKE_SCHEMES, respell

StorageConcurrency = int | Literal["auto"] | None
#: Deep Lake storage threads (and so connections per dataset) with ``storage_concurrency="auto"`` for a dataset
#: in a store: 128 read a whole cold epoch 7-15% faster than 64 at 0, 50 and 100 ms, on 1,000 to 20,000 rows,
#: for the same CPU per sample (benchmarks/results/wan/deeplake.md). Not for one on this machine (``local``):
#: its reads wait on no network, and Deep Lake's memory grows with its threads (benchmarks/results/cpu/).
AUTO_STORAGE_THREADS = 128


def normalize_url(url: str | os.PathLike[str]) -> str:
    """``/data/seg`` and ``file:///data/seg`` name the same dataset, and so do ``gs://b/seg`` and
    ``gcs://b/seg`` (``az://`` and ``azure://``): the object-store spelling is taken and respelt as Deep
    Lake's, so one URL works for both sources. Other schemes pass through."""
    if not isinstance(url, (str, os.PathLike)):
        # A ready view cannot say which dataset rows it holds, nor be re-run identically in a worker.
        raise ConfigError(
            f"url={type(url).__name__} is not allowed: pass the dataset's URL, and a view as its TQL text "
            f"(query='SELECT * WHERE ...')"
        )
    url = os.fspath(url)
    if "://" in url:
        return respell(url, DEEPLAKE_SCHEMES)
    return "file://" + os.path.abspath(url)


#: What ``.result()`` raises for the messages that ``await`` turns into ``RuntimeError`` (Deep Lake 4.7.4
#: keeps the text and drops the type). Read off the message rather than learnt by reading again: every
#: failing read is one more chance of Deep Lake's failing-read segfault (docs/deeplake_failing_read.py).
_TYPES_BY_MESSAGE: tuple[tuple[str, type[Exception]], ...] = (
    ("Key not found", KeyError),
    ("out of range", IndexError),
    ("out of bounds", IndexError),
)


def _typed_cause(exc: BaseException) -> BaseException:
    """``exc`` as the type ``.result()`` would have raised, where its message says which."""
    if type(exc) is not RuntimeError:
        return exc
    text = str(exc)
    for needle, kind in _TYPES_BY_MESSAGE:
        if needle in text:
            typed = kind(text)
            typed.__cause__ = exc
            return typed
    return exc


_ROW = "asyncload_row"  # TQL identifiers cannot start with "_"
_QUERY = re.compile(
    r"^\s*SELECT\s+.*?(?P<rest>(?:\bWHERE\b|\bORDER\s+BY\b|\bSAMPLE\s+BY\b|\bLIMIT\b|\bGROUP\s+BY\b).*)?\s*$",
    re.IGNORECASE | re.DOTALL,
)


def _row_query(query: str) -> str:
    """``query`` run over the dataset with each row's number attached, so a result names dataset rows.

    ``ROW_NUMBER()`` inside ``WHERE``/``ORDER BY`` would number the *result*; numbering in a subquery
    first keeps the dataset's numbering through any filter, order or sample.
    """
    m = _QUERY.match(query) if isinstance(query, str) else None
    if m is None or re.search(r"\bFROM\b", query, re.IGNORECASE):
        raise ConfigError(
            f"query={query!r} is not allowed: a TQL query on this dataset, 'SELECT * [WHERE ...] [ORDER BY ...] "
            f"[SAMPLE BY ...] [LIMIT ...]', without FROM"
        )
    return f"SELECT * FROM (SELECT *, ROW_NUMBER() AS {_ROW}) {m.group('rest') or ''}".rstrip()


def _uint8(t: Any) -> bool:
    """Whether a Deep Lake type's elements are uint8 (an lz4 blob is then one byte per pixel)."""
    return "dtype=uint8" in str(getattr(t, "data_type", "")).replace(" ", "")


#: ``block_rows`` of a Deep Lake dataset: rows kept contiguous in a shuffled epoch (benchmarks/results/large/).
BLOCK_ROWS = 64


class DeepLakeSource(Source[Any]):
    """A Deep Lake dataset, opened read-only in each process that reads it.

    ``url``: ``file://`` or a plain path, ``mem://``, ``s3://``, ``gs://`` (or Deep Lake's ``gcs://``),
    ``az://`` (or ``azure://``), ``al://``; ``creds`` and ``token`` are passed to Deep Lake and never shown
    in a repr or an error. ``storage_concurrency``: ``"auto"`` raises Deep Lake's process-wide storage
    thread pool to 128 before a dataset in a store opens (which fixes its connections) and leaves it for one
    on this machine (``file://``, ``mem://``), an int sets it, ``None`` leaves it.

    ``profile``: for ``s3://``, the shared-config profile whose credentials (and region) to use; without
    it and without keys in ``creds``, the standard AWS chain is asked (environment, shared files, SSO,
    web identity, instance role). ``probe=False`` skips the fast bucket check before Deep Lake opens.

    ``version``: a tag, a branch or a commit id to read instead of the main branch's head; every process
    opens the same one (a handle pickled by Deep Lake itself would re-open the branch head).

    ``query``: a TQL query (``"SELECT * WHERE label = 1"``, ``ORDER BY``, ``SAMPLE BY``, ``LIMIT``) whose
    result is the rows to load. It runs once, in the process that first opens the source; its rows
    travel with the source to DataLoader workers and fan-out processes, so that every process loads the
    same rows even when the query samples at random. The loader's positions are positions in the result
    (what shuffling, shards and resume count), and each batch's ``"index"`` names the dataset row.

    Which queries give the same rows in every process that runs them (Deep Lake 4.7.4, measured in fresh
    processes on one committed version, 2,000 rows): ``WHERE`` filters, ``ORDER BY`` (ties included: the
    order held over repeated runs) and ``LIMIT`` did; ``SAMPLE BY`` draws other rows at each run (TQL takes
    no seed). Deep Lake does not promise either, and a dataset written to between two opens is other rows
    anyway. So where it matters, it is checked: each ``torch.distributed`` rank runs the query in its own
    open, and a loader or dataset that takes its shard from the process group compares every rank's
    ``version`` (which names the query's rows by a digest) when it is built; when they differ every rank
    raises ``RanksDisagreeError`` instead of reading its share of other rows (``engine.ranks``). To train
    on a sampled query under torchrun, open the source on rank 0 and send it to the others
    (``torch.distributed.broadcast_object_list([source])``): an opened source carries its rows.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        columns: Sequence[str] = ("images", "masks"),
        creds: Mapping[str, str] | None = None,
        token: str | None = None,
        *,
        version: str | None = None,
        query: str | None = None,
        profile: str | None = None,
        probe: bool = True,
        storage_concurrency: StorageConcurrency = "auto",
    ) -> None:
        super().__init__(normalize_url(url), columns)
        self._creds = dict(creds) if creds else None
        self._token = token
        self.storage_concurrency = storage_concurrency
        self.profile = profile
        self.probe = probe
        if version is not None and (not isinstance(version, str) or not version or "@" in version):
            raise ConfigError(f"version={version!r} is not allowed: a tag, branch or commit id")
        self.version_spec = version
        self.query = _row_query(query) if query is not None else None
        self._query_text = query
        self._rows: np.ndarray | None = None  # dataset rows of the query's result, in its order
        self._branch: str | None = None
        self._s3: tuple[int, Any] | None = None  # (pid, S3Endpoint) of this process's probe: ``_open_kwargs``
        self._checked = False  # a reader's copy: its parent probed and resolved (``reader_copy``)

    #: Deep Lake's runtime (storage threads, caches) does not survive a fork of a process that used it.
    fork_safe = False
    #: Deep Lake 4.7.4 segfaults now and then while delivering a failed read (docs/deeplake_failing_read.py).
    isolate_reads = True
    #: A reader process opens it for the training process (``Source.describe``): the query's rows and the
    #: branch a version named come back with the description.
    describes = True
    learned_at_open = ("_rows", "_branch")

    @property
    def reader_module(self) -> str:
        """Deep Lake itself, which a reader process imports while this source is on the way (this module
        does not import it); a subclass's own module, which its pickle needs there anyway."""
        return "deeplake" if type(self) is DeepLakeSource else type(self).__module__

    def dataset(self) -> Any:
        """The read-only Deep Lake dataset at this source's version, opened now (no column check): for
        tools such as ``asyncload inspect`` that look at a dataset before choosing columns."""
        import deeplake

        kwargs = self._open_kwargs()
        self._size_storage_pool()
        try:
            ds = deeplake.open_read_only(self.url, **kwargs)
        except Exception as exc:
            if type(exc).__name__ in ("LogNotexistsError", "NotFoundError") or "does not exist" in str(exc):
                raise DatasetNotFoundError(f"no Deep Lake dataset at {self.url}") from None
            raise SourceError(f"cannot open Deep Lake dataset {self.url}: {type(exc).__name__}: {exc}") from None
        if self.version_spec is not None:
            ds = self._open_version(ds, kwargs)
        return ds

    def _open_kwargs(self) -> dict[str, Any]:
        """Deep Lake's ``creds`` and ``token`` for an open in this process. For ``s3://``, the bucket is
        probed first, to fail in seconds naming the setting that is wrong rather than after Deep Lake's
        ~42 s of retries, and the standard credential chain (profile, SSO, instance role...), which Deep
        Lake does not ask, is resolved; both once per process (``_s3``), and not at all in a copy whose
        process was handed what its parent checked (``reader_copy``)."""
        creds = self._creds
        chain = self.profile is not None or not (creds or {}).get("aws_access_key_id")
        if self.url.startswith("s3://") and not self._checked and (self.probe or chain):
            if self._s3 is None or self._s3[0] != os.getpid():
                from .stores.probe import probe_s3_url  # imports aiohttp: only where a probe or the chain runs

                self._s3 = (os.getpid(), probe_s3_url(self.url, creds, profile=self.profile, enabled=self.probe))
            if chain:
                creds = {**self._s3[1].as_creds(), **(creds or {})}  # keys as of now: Deep Lake does not renew them
        kwargs: dict[str, Any] = {}
        if creds:
            kwargs["creds"] = creds
        if self._token:
            kwargs["token"] = self._token
        return kwargs

    def reader_copy(self) -> DeepLakeSource:
        """This source as a reader process opens it: with the credentials this process resolved and its
        bucket probed here (once), so that the reader imports no HTTP client and makes no round trip of
        its own before Deep Lake's open. The keys are taken now, at each reader's start: a chain's
        temporary keys are renewed here, not frozen into every later reader."""
        kwargs = self._open_kwargs()
        checked = copy.copy(self)  # through ``__getstate__``: no handle, no probe of this process
        checked._creds, checked._checked = kwargs.get("creds"), True
        return checked

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_s3"] = None  # this process's probe and chain: each process checks for itself
        return state

    def _open(self) -> Any:
        ds = self.dataset()
        have = [c.name for c in ds.schema.columns]
        missing = [c for c in self.columns if c not in have]
        if missing:
            raise ColumnNotFoundError(
                f"column {missing[0]!r} is not in Deep Lake dataset {self.url} (its columns: {', '.join(have)})"
            )
        if self.query is not None and self._rows is None:
            self._rows = self._run_query(ds)
        return ds

    def _open_version(self, head: Any, kwargs: dict[str, Any]) -> Any:
        """The read-only dataset at ``version``: a tag, a branch (Deep Lake's ``url@branch``) or a commit."""
        import deeplake

        v = self.version_spec
        if v in set(head.tags.names()):
            return head.tags[v].open()
        if v in set(head.branches.names()):
            self._branch = v  # commit ids count from each branch's start: name it in the version
            return deeplake.open_read_only(f"{self.url}@{v}", **kwargs)
        if v in {h.id for h in head.history}:
            return head.history[v].open()
        raise SourceError(
            f"version={v!r} is not a tag, branch or commit of Deep Lake dataset {self.url} (tags: "
            f"{', '.join(sorted(head.tags.names())) or 'none'}; branches: {', '.join(sorted(head.branches.names()))})"
        )

    def _run_query(self, ds: Any) -> np.ndarray:
        try:
            view = ds.query(self.query)
        except Exception as exc:
            raise SourceError(f"query {self._query_text!r} failed on Deep Lake dataset {self.url}: {exc}") from None
        rows = np.asarray(view[_ROW][:], dtype=np.int64).reshape(-1)
        if not len(rows):
            raise SourceError(f"query {self._query_text!r} selects no rows of Deep Lake dataset {self.url}")
        return rows

    @property
    def opens_alike(self) -> bool:
        """Not with a query: its rows (a ``SAMPLE BY`` draws them at random) come from this process's open,
        and a reader that ran the query again would read other rows than the loader names."""
        return self.query is None or self._rows is not None

    def _length(self, handle: Any) -> int:
        return len(handle) if self._rows is None else len(self._rows)

    def row_ids(self, positions: list[int]) -> list[int]:
        """Dataset rows of loader positions: the query's rows, or the positions themselves."""
        if self._rows is None:
            return positions
        return self._rows[positions].tolist()

    @property
    def store_key(self) -> str | None:
        """The dataset (its URL and ``ds.id``: a dataset deleted and re-created at the same URL has another id,
        while its commit ids count from its start again) at its commit (on its branch). Not the query's rows:
        the rows kept are the dataset's (``row_ids``), shared by every query, split and column set of it."""
        ds = self.handle()
        commit = str(ds.version) if self._branch is None else f"{self._branch}:{ds.version}"
        return f"{code_tag(type(self))} {self.url} id={self.identity}|{commit}"

    def _version(self, handle: Any) -> str | None:
        version = str(handle.version)  # the commit a read-only handle is pinned to
        if self._branch is not None:
            version = f"{self._branch}:{version}"
        if self._rows is not None:  # and which of its rows, in which order
            version += f"+rows-sha256:{hashlib.sha256(self._rows.tobytes()).hexdigest()[:16]}"
        return version

    def _identity(self, handle: Any) -> str | None:
        """The dataset's ``id``, which Deep Lake gives each dataset it creates: one deleted and created again
        at this URL has another, while its commit ids (counted from its start) repeat the old one's."""
        ident = getattr(handle, "id", None)
        return None if ident is None else str(ident)

    def __repr__(self) -> str:
        extra = "".join(
            f", {k}={v!r}" for k, v in (("version", self.version_spec), ("query", self._query_text)) if v is not None
        )
        return f"DeepLakeSource({self.url!r}, columns={self.columns!r}{extra})"

    @property
    def preferred_read_mode(self) -> Literal["row", "column"]:
        """ "column" where asyncload decodes the image columns (their stored bytes: JPEG, PNG, lz4 masks),
        "row" elsewhere. A column read of stored bytes is one small request per column and batch, and the
        loop's CPU per sample is a fraction of per-row reads' (benchmarks/results/wan/readmode/). Where Deep
        Lake decodes, one request per sample spreads its decoding over its threads and hedges a straggler
        alone, and column reads measured no faster (benchmarks/results/wan/deeplake.md). (The segfaults
        once blamed on column and stored-bytes reads were Deep Lake crashing on failing reads, on every
        path alike: docs/ARCHITECTURE.md.)"""
        return "column" if any(col.stored for col in self.image_columns().values()) else "row"

    @property
    def local(self) -> bool:
        """A dataset on this machine (``file://``, ``mem://``): the node block store has nothing to save."""
        return self.url.startswith(("file://", "mem://"))

    @property
    def block_rows(self) -> int:
        """Deep Lake reads a range of a chunk far larger than a photo's row (~130-260 KB for a 20 KB JPEG) and
        keeps it only briefly on a dataset larger than its cache: rows read next to their neighbours cost
        their own bytes (benchmarks/results/large/). A query's rows are scattered: 1 there."""
        return 1 if self._query_text is not None else BLOCK_ROWS

    def image_columns(self) -> dict[str, Any]:
        """Image columns (``Image``) and segmentation masks (``SegmentMask``) among the requested ones; the
        stored codec where asyncload decodes it (JPEG, PNG; lz4 for uint8 masks, which the decode stage
        pairs with an image for their shape), else None: Deep Lake decodes."""
        from ..image.codecs import ImageColumn

        schema = self.handle().schema
        found: dict[str, ImageColumn] = {}
        for c in self.columns:
            t = schema[c].dtype
            role = "image" if t.is_image else "mask" if t.is_segment_mask else None
            if role is None or t.is_sequence or t.is_link:
                continue
            codec = {"jpeg": "jpeg", "jpg": "jpeg", "png": "png"}.get(str(t.sample_compression or "").lower())
            if role == "mask" and str(t.sample_compression or "").lower() == "lz4" and _uint8(t):
                codec = "lz4"
            found[c] = ImageColumn(role, codec)  # type: ignore[arg-type]
        return found

    #: A Deep Lake future hangs for ever once cancelled: a read given up on is abandoned, never cancelled.
    cancel_safe = False

    def configure(self, requests_in_flight: int, samples_in_flight: int | None = None) -> None:
        """Nothing to do once the handle is open: Deep Lake sizes a dataset's connections when it opens
        it (see ``_size_storage_pool``), so raising the pool afterwards adds threads, not connections."""

    def _size_storage_pool(self) -> None:
        """Set Deep Lake's process-wide storage pool *before* a dataset is opened, since a dataset's
        connections are fixed at open. ``"auto"``: at least ``AUTO_STORAGE_THREADS`` for a dataset in a store
        (fewer queue reads inside Deep Lake; 256 read slower than 128 at 50 ms, its extra connections starting
        cold: see benchmarks/results/wan/deeplake.md); Deep Lake's own pool for one on this machine, whose
        reads wait on no network: there Deep Lake's default read as fast or faster than 128 threads, for
        less CPU and far less memory, whose per-thread part grows with the pool (benchmarks/results/cpu/).
        An int sets the pool; ``None`` leaves it alone.
        """
        import deeplake

        want = self.storage_concurrency
        if want == "auto":
            if self.local or deeplake.storage.concurrency() >= AUTO_STORAGE_THREADS:
                return
            want = AUTO_STORAGE_THREADS
        if want is not None:
            deeplake.storage.set_concurrency(int(want))

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        ds = self.handle()
        indices = self.row_ids(indices)
        cols = self.columns
        # The row or column objects stay referenced (by ``makers``) until every future has been awaited,
        # rather than trusting Deep Lake to keep a temporary ``ds[c]`` alive while its read is in flight:
        # two full test runs that read columns through temporaries segfaulted in ``await`` of such a read.
        if len(indices) == 1:
            row = ds[indices[0]]
            makers = [lambda c=c: (row.get_bytes_async if c in raw else row.get_async)(c) for c in cols]
        else:
            views = {c: ds[c] for c in cols}
            makers = [lambda c=c: (views[c].get_bytes_async if c in raw else views[c].get_async)(indices) for c in cols]
        # all issued first (they run at once), then each waited for in turn: no task per future
        futures = [m() for m in makers]
        out: Columns = {}
        failed: tuple[int, BaseException] | None = None
        for k, fut in enumerate(futures):
            try:
                res = await completion(fut)
            except Exception as exc:  # noqa: BLE001 - raised once every read has ended
                failed = failed or (k, exc)
                continue
            out[cols[k]] = [res] if len(indices) == 1 else res
        if failed is not None:
            k, cause = failed
            raise read_error(self.url, cols[k], indices, _typed_cause(cause))
        return out
