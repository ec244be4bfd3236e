"""A dataset that is plain image files in an object store: ``images/000123.png`` + ``masks/000123.png``.

``ObjectStoreSource("s3://bucket/prefix")`` (or ``gs://bucket/prefix``, ``az://container/prefix``)
pairs ``<prefix>/<column>/<stem>.<ext>`` objects across columns by their stem, found by listing
(paginated) or named by a manifest (required for ``http(s)://`` prefixes, which cannot be listed); the
pairing rules are in :mod:`.manifest`, decoding in :mod:`..image.files`.

Design, and why:

- **Requests on the loader's loop.** Every object is one aiohttp GET on the running loop; a read of ``n``
  indices issues ``n × columns`` at once. The session (one connection pool) and the decode pool are made
  lazily on the loop that reads and closed when that loop ends (``runtime.loop.LoopLocal``), so the source handle
  (the row → key index) stays plain data that opens on any thread and never crosses a fork.
- **Pool sized to the fan-out, twice over.** ``configure(requests_in_flight)`` × the most indices per
  read × columns, capped by ``max_connections``, because aiohttp's default cap of 100 would queue the
  excess silently; doubled because a hedged-away request keeps its connection until it ends, and without
  that headroom stalled losers fill the pool and every later read waits for them (figures:
  ``benchmarks/results/design_notes.md``). Connections open lazily, so an unused cap costs nothing.
- **One transport for every store** (:mod:`._store`: S3 in :mod:`.s3`, GCS in :mod:`.gcs`, Azure Blob in
  :mod:`.azure`, plain HTTP): the same pool, timeouts, retry policy and typed errors whatever the cloud.
  Credentials come from each cloud's standard chain (:mod:`._creds`), resolved where the source opens
  (never on the loop) and renewed before they expire; the store is per process and never pickled.
- **SigV4 with our own signer** (:mod:`asyncload.sources.stores.sigv4`) over the same session: on 2 cores the client's
  CPU per GET caps throughput, and ours costs less of it than botocore's signer or aiobotocore and needs
  no botocore import (figures: ``benchmarks/results/design_notes.md``; obstore: ``benchmarks/results/transport/``).
- **Retries by policy** (:mod:`asyncload.sources.stores.retry`): transient failures are retried with full-jitter
  backoff within per-request attempts and a per-source-per-process budget; 403/404 fail at once with the
  key named. ``retry_stats()`` shows what it took.
- **One outage, one event** (:class:`asyncload.sources.stores.retry.Breaker`, per source and process): when the store
  stops answering (restart, partition, a silent server), the reads in flight wait for it together while
  one probes it, uncharged to the budget, and resume when it answers; past the loader's
  ``stall_timeout`` (``set_stall_timeout``) they end in ``StallError``.
- **Fast, clear open.** A bucket or container is probed first (:func:`._store.probe_store`; ``probe=False``
  skips it): a down endpoint, wrong credentials or a missing bucket fail in seconds with a ``SourceError``
  naming endpoint and bucket; on S3 the probe also learns the bucket's region when none is configured.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import os
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import numpy as np

from ..errors import ConfigError, DatasetNotFoundError, SourceError, StallError, name_objects, read_error
from ..image.files import DecodeMode, decode_image, decode_modes
from ..runtime.loop import LoopLocal, cores_available, run_blocking, thread_pool
from .base import Columns, Source, code_tag
from .manifest import Keys, Manifest, keys_from_listing, keys_from_manifest, parse_manifest, read_local, stems
from .schemes import OBJECT_STORE_SCHEMES, respell
from .stores.azure import resolve_azure, split_az_url
from .stores.gcs import resolve_gcs, split_gs_url
from .stores.http import HTTPStatusError, Timeouts, new_session, request_bytes
from .stores.retry import Breaker, GiveUp, RetryBudget, RetryPolicy, RetryStats, describe
from .stores.s3 import S3Bucket, S3Endpoint, resolve_s3, split_s3_url
from .stores.store import HTTPStore, Store, probe_store

#: The clouds' URL schemes → how ``scheme://bucket/prefix`` splits into bucket and prefix.
_CLOUDS = {
    "s3": split_s3_url,
    "gs": split_gs_url,
    "az": split_az_url,
    "azure": split_az_url,
}


@dataclass(frozen=True)
class _Index:
    """The opened dataset: for each column, the key (relative to the prefix) of every row."""

    keys: Mapping[str, tuple[str, ...]]
    rows: int
    #: A digest of every row's object's ETag and size, from the listing: what names the objects' contents
    #: (the node block store's key); None for a manifest, or a store whose listing does not give them.
    contents: str | None = None


def _contents(keys: Keys, tags: Mapping[str, str], full_key: Callable[[str], str]) -> str | None:
    """A digest of each row's objects' ETags and sizes, in row order; None where one is missing."""
    h = hashlib.sha256()
    for col in sorted(keys):
        for rel in keys[col]:
            tag = tags.get(full_key(rel))
            if tag is None:
                return None
            h.update(tag.encode() + b"\0")
    return f"etags-sha256:{h.hexdigest()[:16]}"


def _namer(ref: weakref.ref[ObjectStoreSource], keys: Keys) -> Callable[[str, int], str | None]:
    """``(column, row)`` → the object's URL while the source lives (``errors.name_objects``)."""

    def name(column: str, row: int) -> str | None:
        src = ref()
        if src is None or column not in keys or not 0 <= row < len(keys[column]):
            return None
        return f"{src.url}/{keys[column][row]}"

    return name


@dataclass
class _LoopState:
    """What one event loop reads with: the HTTP session and the decode pool."""

    session: aiohttp.ClientSession
    pool: ThreadPoolExecutor


async def _close_state(state: _LoopState) -> None:
    await state.session.close()
    state.pool.shutdown(wait=True, cancel_futures=True)  # idle by now: every read was awaited


class ObjectStoreSource(Source[_Index]):
    """Image/mask files under an ``s3://``, ``gs://``, ``az://`` or ``http(s)://`` prefix.

    **Layout**: one folder per column, one file per sample, ``<prefix>/<column>/<stem>.<ext>``::

        s3://bucket/photos/images/beach_001.jpg     s3://bucket/photos/masks/beach_001.png
        s3://bucket/photos/images/beach_002.jpg     s3://bucket/photos/masks/beach_002.png

    ``ObjectStoreSource("s3://bucket/photos")`` reads columns ``("images", "masks")`` (``columns=`` names
    others). The stem is the key below ``<column>/`` without its last extension, and may hold folders
    (``images/2024/a.jpg`` has stem ``2024/a``). Any image format a column's files are in: JPEG and PNG
    are decoded by asyncload's own decoders, anything else by Pillow; a column whose name contains
    "mask" is decoded as one channel of class ids (``decode=`` overrides it per column).

    **Listing** (no ``manifest``): every key under ``<prefix>/<column>/`` is listed once, at open,
    paginated (``list_page_size`` keys a request; folder markers skipped). **Pairing**: files pair
    across columns by stem; the rows are the stems found in *every* column, in sorted order; a stem
    missing from some column is skipped with one warning naming how many and the first; two files of
    one column with one stem (``a.jpg`` and ``a.png``) are an error naming both. So ``len(source)`` is
    the number of complete pairs, and row ``i`` is the ``i``-th stem in sorted order.

    **Manifest** (required for ``http(s)://`` prefixes, which cannot be listed; optional elsewhere, and
    then nothing is listed): row ``i`` is the manifest's ``i``-th entry, in its order. A manifest is a
    URL (``s3://`` in the same bucket, ``http(s)://``), a local path, or the rows themselves. Its rows
    are stems (each column's key is ``<column>/<stem><suffix>``, ``suffixes`` per column, default
    ``.png``) or ``{column: key}`` mappings (keys relative to the prefix). As a file: a JSON list, a
    JSON ``{"stems": [...]}``, or text with one stem per line (blank lines and ``#`` comments skipped).

    **Errors** name the object: a failed GET or a file that does not decode raises a ``ReadError``
    naming the column, the row and the object's key (``s3://bucket/photos/images/beach_002.jpg``).

    ``creds``: the store's credentials (S3: Deep Lake's ``aws_*`` keys and ``endpoint_url``; GCS: ``token``
    or a service-account key; Azure: ``account_name`` with ``account_key``/``sas_token``, or
    ``connection_string``); without them, the cloud's standard chain (:mod:`._creds`), else anonymous.
    ``profile``: the AWS profile (else ``AWS_PROFILE``). ``probe``: False skips the open probe (the S3
    region is then the configured one). ``manifest``:
    a URL (``s3://``, ``http(s)://``), a local path, or a list of stems / ``{column: key}`` rows.
    ``suffixes``: the extension per column for manifest stems (default ``.png``). ``decode``: ``rgb`` or
    ``gray`` per column (default: ``gray`` for columns whose name contains "mask", else ``rgb``).
    ``retry``: a :class:`~asyncload.sources.stores.retry.RetryPolicy`; ``timeouts``: a :class:`Timeouts`.
    ``connections``: fix the pool size instead of deriving it from the loader (capped by
    ``max_connections``). ``verify_tls``: False turns certificate checks off, a path names a CA bundle.
    ``open_deadline``: seconds the bucket probe may take. ``list_page_size``: keys per listing page (S3
    caps it at 1,000).
    """

    def __init__(
        self,
        url: str,
        columns: Sequence[str] = ("images", "masks"),
        creds: Mapping[str, str] | None = None,
        manifest: Manifest | None = None,
        *,
        suffixes: Mapping[str, str] | None = None,
        decode: Mapping[str, DecodeMode] | None = None,
        retry: RetryPolicy | None = None,
        timeouts: Timeouts | None = None,
        connections: int | None = None,
        max_connections: int = 1024,
        verify_tls: bool | str = True,
        decode_workers: int | None = None,
        open_deadline: float = 5.0,
        list_page_size: int = 1000,
        profile: str | None = None,
        probe: bool = True,
    ) -> None:
        url = respell(str(url).rstrip("/"), OBJECT_STORE_SCHEMES)
        super().__init__(url, columns)
        scheme = url.split("://", 1)[0].lower() if "://" in url else ""
        if scheme not in (*_CLOUDS, "http", "https"):
            raise ConfigError(
                f"url={url!r} is not allowed: use s3://bucket/prefix, gs://bucket/prefix, az://container/prefix "
                "or an http(s):// prefix"
            )
        if scheme not in _CLOUDS and manifest is None:
            raise ConfigError(
                f"manifest=None is not allowed for {url}: an HTTP prefix cannot be listed, pass a manifest "
                "(a URL, a local file or a list of stems)"
            )
        self._scheme = scheme
        self._creds = dict(creds) if creds else None
        self._manifest = manifest
        self._suffixes = {c: ".png" for c in self.columns} | dict(suffixes or {})
        self._decode = decode_modes(self.columns, decode)
        self.retry = retry or RetryPolicy()
        self.timeouts = timeouts or Timeouts()
        self._connections = connections
        self.max_connections = max_connections
        self.verify_tls = verify_tls
        self._decode_workers = decode_workers or cores_available()
        self.open_deadline = open_deadline
        self.list_page_size = list_page_size
        self.profile = profile
        self.probe = probe
        self._bucket = self._prefix = ""
        if scheme in _CLOUDS:
            try:
                self._bucket, self._prefix = _CLOUDS[scheme](url)
                if scheme == "s3" and self._creds and {"aws_access_key_id", "aws_secret_access_key"} & set(self._creds):
                    S3Endpoint.resolve(self._creds)  # both keys or neither: say so now, not at open
            except ValueError as exc:
                raise ConfigError(f"url={url!r}: {exc}") from None
        self._requests_in_flight = 64
        self._indices_per_read = 1  # the most indices one read has asked for: sizes the pool
        self._stall_timeout = 120.0  # the loader's stall_timeout: bounds the wait for a store that is away
        self._carried: _Index | None = None  # a reading process's copy: the keys its parent found (reader_copy)
        self._init_process_state()

    # -- per-process state (never pickled, reset after fork) -----------------------------------------
    def _init_process_state(self) -> None:
        self._state_pid = os.getpid()
        self._store: Store | None = None  # resolved at open, in this process (a live credential chain)
        self._budget: RetryBudget = self.retry.new_budget()
        self._stats = RetryStats()
        self._received = 0  # bytes of the objects' bodies received in this process (``received_bytes``)
        # (a little past the deadline: the loader's watchdog, which names every row in flight, ends it first)
        self._breaker = Breaker(self.url, self.retry, self._stats, self._stall_timeout + 5.0)
        self._loops: LoopLocal[_LoopState] = LoopLocal(
            self._new_loop_state, _close_state, "asyncload-objectstore-session"
        )

    def _process_state(self) -> tuple[RetryBudget, RetryStats, LoopLocal[_LoopState]]:
        if self._state_pid != os.getpid():
            self._init_process_state()
        return self._budget, self._stats, self._loops

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        for k in ("_budget", "_stats", "_loops", "_state_pid", "_store", "_breaker", "_received"):
            state.pop(k, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self._init_process_state()

    def retry_stats(self) -> dict[str, Any]:
        """Requests, attempts, retries, give-ups and causes in this process, and the budget left."""
        budget, stats, _ = self._process_state()
        return stats.snapshot() | {"budget_left": budget.tokens, "budget": budget.capacity}

    def throttle_count(self) -> int:
        """503 and 429 answers seen in this process (the concurrency tuner backs off on them)."""
        causes = self.retry_stats()["causes"]
        return sum(n for cause, n in causes.items() if cause.startswith(("HTTP 503", "HTTP 429")))

    def retry_count(self) -> int:
        return int(self.retry_stats()["retries"])

    def received_bytes(self) -> int:
        """Bytes of the objects' bodies this process has received from the store, as they crossed the wire
        (the files' stored bytes, whatever ``decode=`` makes of them; hedged and retried GETs that answered
        count each time). The read stage reports its epoch's part as ``stats()["remote_bytes"]``. Listing
        and the manifest, read once per open, are not counted."""
        self._process_state()
        return self._received

    # -- Source contract -----------------------------------------------------------------------------
    @property
    def preferred_read_mode(self) -> Literal["row", "column"]:
        """Per-row reads: every object is its own GET whatever the mode, so column reads fold nothing,
        and a column read holds its fetcher until its slowest object arrives; one read per sample keeps
        ``concurrency`` samples in flight all the time (measured: ``benchmarks/results/design_notes.md``)."""
        return "row"

    def configure(self, requests_in_flight: int, samples_in_flight: int | None = None) -> None:
        self._requests_in_flight = max(1, int(requests_in_flight))

    def outage(self) -> str | None:
        """The breaker is open: the last failure that met no answer (refused, reset, timed out)."""
        self._process_state()
        b = self._breaker
        if not b.is_open or b.last is None:
            return None
        return f"the store is away since {time.monotonic() - b.opened_at:.1f} s ago; last attempt: {describe(b.last)}"

    def set_stall_timeout(self, seconds: float) -> None:
        """Reads wait for a store that is away (the breaker open) up to ``seconds`` and a little more."""
        self._stall_timeout = float(seconds)
        self._process_state()
        self._breaker.max_outage = self._stall_timeout + 5.0

    @property
    def store_key(self) -> str | None:
        """The node block store's name for these rows: the keys and every object's ETag and size, as the
        listing gave them, so a file rewritten under the same key is read again, never served from an
        older copy (Lightning-AI/litdata#292). None (not kept) for a manifest, which names keys only."""
        contents = self.handle().contents
        version = self.version
        if contents is None or version is None:
            return None
        return f"{code_tag(type(self))} {self.url}|{version}+{contents}"

    @property
    def unkept_reason(self) -> str | None:
        """Why ``store_key`` is None, as it is: the node store keeps an object's bytes under its ETag, so that
        a rewritten object is fetched again, and a manifest names keys only."""
        if self.handle().contents is not None:
            return None
        if self._manifest is not None:
            return (
                "a manifest names the objects' keys but gives no ETags, so an object rewritten under its key "
                "could not be told from the copy kept (without a manifest, the listing gives them)"
            )
        return "the store's listing gave no ETags, so an object rewritten under its key could not be told from the copy kept"

    def value_tag(self, column: str) -> str:
        """How ``read`` decodes ``column``'s files (``decode=``): loaders that decode it otherwise keep their
        own values."""
        return str(self._decode[column])

    def _version(self, handle: _Index) -> str | None:
        """A digest of every row's keys, in row order: another listing or manifest is another version."""
        h = hashlib.sha256()
        for col in sorted(handle.keys):
            h.update(col.encode() + b"\0" + "\0".join(handle.keys[col]).encode() + b"\1")
        return f"keys-sha256:{h.hexdigest()[:16]}"

    def _identity(self, handle: _Index) -> str | None:
        """None: a bucket and prefix have no id of their own beyond the URL (``scheme://bucket/prefix``, in
        every state already), and what they hold is the version (the keys' digest)."""
        return None

    def _length(self, handle: _Index) -> int:
        return handle.rows

    def _open(self) -> _Index:
        # No overall limit: listing a large prefix takes one request per 1,000 keys, each bounded by the
        # probe's deadline or the retry policy.
        return run_blocking(self._open_async, timeout=None, what=f"opening {self.url}")

    def _close_handle(self, handle: _Index | None) -> None:
        _, _, loops = self._process_state()
        loops.close_all()

    def _resolve_store(self) -> Store:
        """This source's store with its identity (blocking: a credential chain may read files or ask a
        metadata service)."""
        try:
            if self._scheme == "s3":
                return S3Bucket(resolve_s3(self._creds, self.profile), self._bucket)
            if self._scheme == "gs":
                return resolve_gcs(self.url, self._creds)
            if self._scheme in ("az", "azure"):
                return resolve_azure(self.url, self._creds)
        except ValueError as exc:
            raise ConfigError(f"cannot open {self.url}: {exc}") from None
        return HTTPStore(self.url)

    def store(self) -> Store:
        """The store this process reads from (opening the source if needed)."""
        self.handle()
        assert self._store is not None
        return self._store

    def reader_copy(self) -> ObjectStoreSource:
        """This source as a reading process (a fan-out worker) is given it: carrying the keys this process
        listed or read from the manifest, its bucket probed here. Such a copy opens with no request at all,
        so that a worker started while the store is silent (the replacement of one stuck in its reads) waits
        for the store in its reads, within ``stall_timeout``, as Deep Lake's reader does, instead of failing
        a 5 s probe or a listing (``S3EndpointError`` ended the epoch of a fan-out whose stall outlasted the
        stuck-worker limit)."""
        index = self.handle()
        checked = copy.copy(self)  # through ``__getstate__``: no handle, no session, no store of this process
        checked._carried = index
        return checked

    async def _open_async(self) -> _Index:
        budget, stats, _ = self._process_state()
        store = await asyncio.to_thread(self._resolve_store)
        if self._carried is not None:  # what the parent found (``reader_copy``): nothing to ask the store
            self._store = store
            name_objects(self.url, _namer(weakref.ref(self), self._carried.keys))
            return self._carried
        if self.probe and store.listable:
            store = await probe_store(
                store, self._prefix, deadline=self.open_deadline, verify_tls=self.verify_tls, what=self.url
            )
        self._store = store
        tags: dict[str, str] = {}
        async with new_session(len(self.columns), self.timeouts, self.verify_tls) as session:
            if self._manifest is not None:
                rows = await self._load_manifest(session, budget, stats)
                keys = keys_from_manifest(rows, self.columns, self._suffixes, self.url)
            else:
                keys = await self._keys_from_listing(session, budget, stats, tags)
        n = len(next(iter(keys.values())))
        name_objects(self.url, _namer(weakref.ref(self), keys))  # errors name the file: read_error
        if n == 0:
            raise DatasetNotFoundError(
                f"no samples at {self.url}: expected objects {', '.join(f'{c}/<stem>' for c in self.columns)}"
                + ("" if self._manifest is not None else " (found by listing)")
            )
        return _Index(keys, n, _contents(keys, tags, self._full_key) if tags else None)

    # -- listing and manifests -----------------------------------------------------------------------
    def _full_key(self, rel: str) -> str:
        return f"{self._prefix}/{rel}" if self._prefix else rel

    async def _get(
        self,
        session: aiohttp.ClientSession,
        url: str,
        what: str,
        budget: RetryBudget,
        stats: RetryStats,
        store: Store | None = None,
        *,
        breaker: Breaker | None = None,
    ) -> bytes:
        store = store or self._store
        assert store is not None

        async def attempt() -> bytes:
            headers = await store.headers("GET", url)
            return await request_bytes(session, "GET", url, headers, allow_redirects=not store.signed)

        return await self.retry.call(attempt, what=what, budget=budget, stats=stats, breaker=breaker)

    async def _list(
        self,
        session: aiohttp.ClientSession,
        prefix: str,
        budget: RetryBudget,
        stats: RetryStats,
        tags: dict[str, str] | None = None,
    ) -> list[str]:
        """Every key under ``prefix`` (``list_page_size`` per page, following continuation tokens); each
        key's ETag and size go into ``tags`` where the listing gives them."""
        store = self._store
        assert store is not None
        keys: list[str] = []
        token: str | None = None
        while True:
            url = store.list_url(prefix, token, self.list_page_size)
            try:
                body = await self._get(session, url, f"listing {self._scheme}://{self._bucket}/{prefix}", budget, stats)
            except GiveUp as g:
                raise SourceError(f"cannot list {self.url} at {store.kind} endpoint {store.endpoint}: {g}") from None
            page, token = store.parse_list(body)
            keys += page
            if tags is not None:
                tags.update(store.parse_tags(body))
            if not token:
                return keys

    async def _keys_from_listing(
        self, session: aiohttp.ClientSession, budget: RetryBudget, stats: RetryStats, tags: dict[str, str]
    ) -> Keys:
        by_column: dict[str, dict[str, str]] = {}
        for col in self.columns:
            keys = await self._list(session, self._full_key(f"{col}/"), budget, stats, tags)
            rels = [key[len(self._prefix) + 1 :] if self._prefix else key for key in keys]
            by_column[col] = stems(col, rels, self.url)
        return keys_from_listing(by_column, self.url)

    async def _load_manifest(
        self, session: aiohttp.ClientSession, budget: RetryBudget, stats: RetryStats
    ) -> Sequence[str | Mapping[str, str]]:
        m = self._manifest
        if not isinstance(m, (str, os.PathLike)):
            return list(m)  # type: ignore[arg-type]
        where = respell(os.fspath(m), OBJECT_STORE_SCHEMES)
        scheme = where.split("://", 1)[0].lower() if "://" in where else ""
        if scheme in (*_CLOUDS, "http", "https"):
            store: Store = HTTPStore("")
            if scheme in _CLOUDS:
                if scheme != self._scheme and {scheme, self._scheme} != {"az", "azure"}:
                    raise ConfigError(f"manifest={where!r} is on {scheme}:// but url={self.url!r} is not")
                bucket, key = _CLOUDS[scheme](where)
                assert self._store is not None
                if bucket != self._bucket and not isinstance(self._store, S3Bucket):
                    raise ConfigError(f"manifest={where!r} must be in the same bucket as url={self.url!r}")
                store = S3Bucket(self._store.s3, bucket) if isinstance(self._store, S3Bucket) else self._store
                url = store.object_url(key)
            else:
                url = where
            try:
                data = await self._get(session, url, f"GET manifest {where}", budget, stats, store)
            except GiveUp as g:
                cls = DatasetNotFoundError if getattr(g.last, "status", None) == 404 else SourceError
                raise cls(f"cannot read the manifest of {self.url}: {g}") from None
        else:
            path = where.removeprefix("file://")
            try:
                data = await asyncio.to_thread(read_local, path)
            except OSError as exc:
                raise DatasetNotFoundError(
                    f"cannot read the manifest of {self.url} at {path}: {describe(exc)}"
                ) from None
        return parse_manifest(data, where)

    # -- reading -------------------------------------------------------------------------------------
    def _new_loop_state(self) -> _LoopState:
        session = new_session(self.connections(), self.timeouts, self.verify_tls)
        pool = thread_pool(self._decode_workers, "asyncload-decode")
        return _LoopState(session, pool)

    def connections(self) -> int:
        """The pool size a session created now would get (for logs and tests)."""
        # ×2: headroom for hedged reads (see the module docstring)
        want = self._connections or 2 * self._requests_in_flight * self._indices_per_read * len(self.columns)
        return max(1, min(self.max_connections, want))

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        index = self.handle()
        budget, stats, loops = self._process_state()
        self._indices_per_read = max(self._indices_per_read, len(indices))
        state = loops.get()
        loop = asyncio.get_running_loop()
        tasks = [
            loop.create_task(self._read_one(state, budget, stats, col, index.keys[col][i], i, col in raw))
            for col in self.columns
            for i in indices
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)
        first: BaseException | None = None
        for t in tasks:  # retrieve every failure (else asyncio logs "exception was never retrieved")
            exc = None if t.cancelled() else t.exception()
            if exc is not None and first is None:
                first = exc
        if first is not None:
            raise first
        n = len(indices)
        return {col: [t.result() for t in tasks[k * n : (k + 1) * n]] for k, col in enumerate(self.columns)}

    async def _read_one(
        self, state: _LoopState, budget: RetryBudget, stats: RetryStats, col: str, rel: str, i: int, raw: bool
    ) -> np.ndarray:
        """The file ``rel`` of column ``col`` (row ``i``): its bytes where ``raw`` (the loader decodes them),
        else decoded here."""
        assert self._store is not None
        url = self._store.object_url(self._full_key(rel))
        where = f"{self.url}/{rel}"
        try:
            data = await self._get(state.session, url, f"GET {where}", budget, stats, breaker=self._breaker)
        except GiveUp as g:
            if g.outage_s is not None:  # the store was away past the deadline (outside a loader's watchdog)
                raise StallError(
                    f"no answer from {self.url} for {g.outage_s:.1f} s (stall_timeout): {g}",
                    source=self.url,
                    indices=[i],
                    waited_s=g.outage_s,
                ) from g.last
            raise read_error(self.url, col, [i], g.as_builtin())  # noqa: B904 - read_error sets __cause__
        self._received += len(data)
        if raw:  # the loader's decode stage decodes it, into the batch
            return data
        try:
            return await asyncio.get_running_loop().run_in_executor(
                state.pool, decode_image, data, self._decode[col], where
            )
        except ValueError as exc:
            raise read_error(self.url, col, [i], exc)  # noqa: B904 - read_error sets __cause__

    def image_columns(self) -> dict[str, Any]:
        """Every column is an image file: ``rgb`` ones images, ``gray`` ones masks; the stage sniffs each
        file's codec (JPEG, PNG, else Pillow)."""
        from ..image.codecs import ImageColumn

        return {c: ImageColumn("image" if self._decode[c] == "rgb" else "mask", "file") for c in self.columns}

    def __repr__(self) -> str:
        return f"ObjectStoreSource({self.url!r}, columns={self.columns!r})"


#: ``decode_image`` and ``parse_manifest`` live in :mod:`..image.files` and :mod:`.manifest`; still importable here.
__all__ = ["ObjectStoreSource", "Timeouts", "RetryPolicy", "HTTPStatusError", "decode_image", "parse_manifest"]
