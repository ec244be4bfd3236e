"""``AsyncLoader``: the public loader. It owns what the user touches: epochs, resume state, the
lifetime of what reads (a loop thread, or fan-out worker processes), and hands each epoch out as an
``epoch.Epoch``.

- **One set of options.** ``LoaderOptions`` (``options``) is validated once, here or by the caller, and
  is what fan-out workers and the torch adapter build their loaders from.
- **No spinning.** The consumer blocks on a thread-safe queue (``epoch``); the loop thread sleeps in its
  selector until a read completes.
- **Exact epochs.** Each batch of the shard's plan is read once and yielded once; the consumed ones are
  recorded (``state_dict``) so that a resumed epoch yields exactly the rest.
- **Lifetimes.** An epoch's loop thread starts on its first ``next()`` in the process that iterates and
  is stopped and joined when the epoch ends, on ``break`` (iterator close or garbage collection), on an
  error, and at interpreter exit. Reads in flight are awaited first, bounded by ``shutdown_timeout``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from .engine.consumed import cut_of, merge, order_of, resume_cut
from .engine.epoch import Epoch, EpochIterator
from .engine.options import LoaderOptions, ReadMode
from .engine.progress import EpochProgress, dataset_of
from .engine.ranks import check_ranks_agree
from .engine.sampler import PROCESS_GROUP, EpochSampler, Ranges, Shard, resolve_shard
from .engine.shard import ShardEpochs
from .engine.slowest import RankBoard, exchange
from .engine.stats import Stats
from .errors import ConfigError
from .processes.fanout import FanoutIterator, WorkerPool
from .processes.isolated import IsolatedSource
from .runtime.alloc import release_spares
from .runtime.mainmod import unreachable_from_main
from .runtime.settings import check as _check
from .sources.base import Source

log = logging.getLogger("asyncload")


class AsyncLoader:
    """Batches from a ``Source``, read by coroutines on a background event loop.

    This is the one list of the loader's settings (``LoaderOptions`` holds the same names, validated
    once; ``tests/test_docs.py`` fails when a setting is missing here). Pass them as keyword arguments,
    or ``options=LoaderOptions(...)``. A misspelt name is refused with the nearest known one.

    What is read, and in what order:
      batch_size    samples per batch (default 32; also the second positional argument)
      shuffle, seed the order of an epoch (default False, 0); ``set_epoch(e)`` selects the epoch (like
                    DistributedSampler): the same seed and epoch give the same order on every process
      shuffle_block rows read together in a shuffled epoch: blocks of this many contiguous rows come in
                    a random order and each is read once, in one request (``blocks``), so a dataset
                    larger than memory streams at its stored bytes. "auto" (default): the source's
                    ``block_rows`` (64 for Deep Lake, 1 for object stores); 1: a full shuffle
      shuffle_window  positions a block's rows are spread over (default 4096; at most about half the
                    dataset, not under 1,024): a batch mixes about ``shuffle_window / shuffle_block``
                    blocks; the rows read ahead wait on the node block store's disk (or, without
                    it, in memory, within ``memory_budget``) (benchmarks/results/large/)
      shuffle_scope "node" (default): under torchrun on several nodes, each node keeps the same part
                    of the blocks every epoch and shuffles within it, so the cluster fetches the
                    dataset about once (``engine.nodes``); "global": every rank draws from all blocks
                    every epoch (each node then fetches and keeps nearly the whole dataset)
      drop_last     leave out a last batch shorter than ``batch_size`` (default False)
      rank, world_size  which rank's share of each epoch this loader serves; by default the rank of
                    the initialised ``torch.distributed`` process group (every rank of a torchrun job
                    reads its own share, exactly as ``AsyncIterableDataset`` does), else the whole epoch
      shard         the rank and DataLoader-worker share, explicitly (instead of rank/world_size)
      remainder     "pad" (default) or "drop" when ranks do not divide the dataset (see ``sampler``)
      start_batch   leave out the rank's first N batches of every epoch this loader runs (how
                    ``AsyncIterableDataset`` resumes DataLoader workers; see ``sampler``)
      in_order      True (default): batches in sampler order (reorder buffer); False: as they complete

    The node block store (``nodestore``): each block fetched once per machine, kept on local disk
    for every process, later epoch and later run of the same dataset version:
      cache         "auto" (default): on for remote sources whose version is known (Deep Lake; object
                    stores read by listing, keyed by every object's ETag and size), off for local
                    paths and manifests; True, False
      cache_dir     where it lives (default: $ASYNCLOAD_CACHE_DIR, else the first on a local disk of
                    $XDG_CACHE_HOME/asyncload/blocks (~/.cache/...), $TMPDIR/asyncload-<uid>/blocks,
                    /var/tmp/asyncload-<uid>/blocks: network and memory file systems are skipped);
                    a directory of the user's, made private (0700), another user's refused
      cache_limit   bytes it may use on this machine, all datasets together, as the disk holds them
                    (whole blocks, the index included): an int, or a size such as "50GB" (10^9 bytes
                    each) or "50GiB" (2^30) ("auto", default: a quarter of the free space, at most
                    256 GiB); past it what is there stays and the rest is read from the store
                    (``stats()["node_hit_rate"]``); 5% of the file system (at most 1 GiB) is never
                    written into

    How it is read:
      concurrency   samples being read at once (hundreds are fine for remote stores), or "auto"
                    (default): tuned online between 1 and ``max_concurrency`` (see ``tuning``)
      max_concurrency  the most samples in flight "auto" may choose (default 512; bounds memory)
      prefetch      ready batches kept ahead of the consumer (default 4)
      read_mode     "column": one request per column for ``request_size`` indices at once;
                    "row": one request per sample and column; "auto" (default): what the source
                    measured faster (``Source.preferred_read_mode``)
      request_size  indices per column request in "column" mode (default: the batch size)
      hedge         a read slower than ``hedge`` × the recent p99 latency gets a second request; the
                    first answer wins (default 3.0; None: never hedge). Hedges are counted in ``stats()``
      memory_budget bytes the pipeline may hold, read, decoded and ready: an int, or a size such as
                    "500MB" (10^6 bytes each) or "2GiB" (2^30) ("auto", default: 1 GiB, or an eighth
                    of the machine's memory where that is less); a new batch starts only while the
                    batches alive fit, and one batch is always allowed
      stall_timeout seconds an epoch waits for a store that does not answer (default 120): within it
                    an outage is ridden out (reads retried, a stuck reader process replaced); past it
                    the epoch raises a ``ReadError`` naming the store, the wait and the rows in flight
      on_error      "raise" (default): a failed read or transform raises in the consumer;
                    "skip": the bad samples are left out, counted in ``stats()`` and reported at
                    the end of the epoch (a failed request is re-read sample by sample first)

    Images (``asyncload.image``; image and mask columns of Deep Lake, every file of an object store):
      decode        where images are decoded: "auto" (default: "cpu" where asyncload has the decoder,
                    JPEG, PNG and lz4 masks read as stored bytes), "cpu" (asyncload's decoders on its
                    CPU pool, straight into the batch), "store" (the store decodes, e.g. Deep Lake's
                    ``get_async``), "cuda" / "cuda:N" (nvJPEG on the GPU; batches arrive there)
      augment       a list of ``Resize``, ``RandomResizedCrop`` and ``RandomHorizontalFlip`` (at most
                    one resize): one draw per sample, a hash of (seed, epoch, row), applied alike to
                    the image and every mask column (nearest for masks), in the decode stage
      normalize     ``(mean, std)`` per channel on pixels scaled to 0..1 (torchvision's
                    ``ToDtype(scale=True)`` then ``Normalize``), image columns only (default None)
      layout        "NHWC" (default) or "NCHW" for image batches
      dtype         image columns as ``torch.float32``, ``float16`` or ``bfloat16`` (default None: uint8,
                    or float32 with ``normalize``). ``normalize``, ``layout`` and ``dtype`` apply to the
                    default batch: not with a ``transform`` or ``collate_fn``
      cpu_workers   threads of the CPU pool that decodes, augments, transforms and collates (default
                    None: one per core this process may run on, at least 2)

    Samples into batches:
      transform     per-sample callable on ``{column: array, "index": int}`` (arrays are read-only
                    views), run on the CPU pool after the augmentation
      collate_fn    turns the list of (transformed) samples into a batch
      ragged        columns whose samples differ in shape: "list" (a list of tensors) or "pad"
                    (zero-padded to the batch's largest shape, with a ``<column>_mask``), for every
                    column or as ``{column: ...}``; None (default): raise ``CollateError``. Equal shapes
                    always stack; text columns come back as lists of ``str``
      with_index    add an ``"index"`` int64 tensor of dataset indices to default batches (default True)

    Processes and threads:
      processes     "auto" (default): a source whose failing reads can crash the process that runs
                    them (Deep Lake: ``Source.isolate_reads``) is read in one reader process, so a
                    crash costs a restarted reader, never the training run; only the reads cross
                    (``isolated``), the batches are made here. Other sources are read here.
                    0: read in this process (turns the isolation off). K: K worker processes, each
                    with its own event loop and store handle, share the epoch (CPU-heavy transforms
                    scale). Their batches come back through shared memory; transform/collate_fn must
                    be picklable. Inside a DataLoader worker (daemonic) "auto" reads through the
                    node's shared reader where there is one (``shared_reader``), else in that worker
      max_restarts  deaths of reader processes per epoch that are survived (default 3): the dead
                    reader is replaced and what it held is read again; a batch whose read kills a
                    reader again is narrowed down to its rows (``ReaderCrashError``, or skipped with
                    ``on_error="skip"``); one death more ends the epoch with ``WorkerError``
      shared_reader True (default): where the node block store is on, that reader process is the
                    node's (one per ``cache_dir``), shared by every loader of the node, so that
                    Deep Lake's pages and headers are fetched once per node, not once per rank and
                    DataLoader worker (``nodereader``); a loader whose shared reader dies reads in
                    one of its own (a DataLoader worker: reads in itself) from then on. False: a
                    reader process per loader
      mp_context    "forkserver" (default: a worker starts as a fork of a server that imported
                    torch once) or "spawn", for the ``processes=K`` workers. A reader process always
                    starts by spawn: it imports the source and Deep Lake, never torch
      loop          the event loop: "auto" (default: uvloop when installed), "uvloop" or "asyncio"
      shutdown_timeout  seconds an epoch's stop (``close()``, ``break``, an error) waits for its reads
                    in flight before it abandons them (default 10; at interpreter exit, Ctrl-C
                    included, 1 s)
      log_every     seconds between INFO lines of live stats on the "asyncload" logger (default None:
                    off). Python shows INFO lines only once logging is configured, e.g.
                    ``logging.basicConfig(level=logging.INFO)``; ``asyncload load --log-every S`` does it

    ``close()`` stops the epoch, the reader process and the ``processes=K`` workers. With
    ``mp_context="forkserver"``, multiprocessing's forkserver process (torch imported once, shared by
    every pool of this process) stays until the interpreter exits: multiprocessing keeps it for the
    next pool, by design.
    """

    #: ``processes=K``: the persistent worker processes (``fanout.WorkerPool``), started by the first
    #: epoch's first ``next()`` and kept until ``close()`` or garbage collection.
    _pool: Any = None

    def __init__(
        self,
        source: Source[Any],
        batch_size: int | None = None,
        *,
        shard: Shard | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        options: LoaderOptions | None = None,
        **settings: Any,
    ) -> None:
        if not isinstance(source, Source):
            raise ConfigError(f"source={source!r} is not allowed: pass a Source such as DeepLakeSource(url)")
        if batch_size is not None:  # positional, as in DataLoader(ds, 32); else the options' (32)
            settings["batch_size"] = batch_size
        o = LoaderOptions.of(settings, options)
        if o.decode.startswith("cuda"):
            from .image.gpu import require_torchvision

            require_torchvision(o.decode)
        try:
            shard, shard_from = resolve_shard(shard, rank, world_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if o.with_index and "index" in source.columns:
            raise ConfigError("with_index=True is not allowed with a column named 'index': pass with_index=False")
        self.options = o
        #: ``processes="auto"`` on a source whose reads can crash this process: its reads, and only they,
        #: run in a reader process (``isolated``); the pipeline and the decoding stay here
        self._isolated = reader_for(source, o)
        #: reader processes: ``processes``, or with "auto" one for a source whose failing reads can crash
        #: this process (Deep Lake) and can be pickled into one, none otherwise (``reader_for``)
        self.processes = int(self._isolated is not None) if o.processes == "auto" else int(o.processes)
        opening = time.perf_counter()
        self.source = open_through(source, self._isolated)
        self._open_s = time.perf_counter() - opening
        if shard_from == PROCESS_GROUP:  # every rank builds it: they compare what they opened (``ranks``)
            try:
                check_ranks_agree(self.source, node_scope=o.shuffle and o.shuffle_scope == "node")
            except BaseException:
                if self._isolated is not None:
                    self._isolated.close()
                raise
        #: where this rank posts its epochs' figures and rank 0 reads every rank's (``engine.slowest``)
        self._board = RankBoard.of_process_group() if shard_from == PROCESS_GROUP else None
        self._ranks: dict[str, Any] = {}  # the slowest rank of the last epoch every rank posted (rank 0)
        self.shard = shard
        self._shard = ShardEpochs(self._isolated or self.source, o, shard)
        self.read_mode: ReadMode = self._shard.read_mode
        self.sampler = self._shard.sampler
        if shard.world_size > 1 or shard_from != "no process group":
            log.info(
                "asyncload: %s reads rank %d of %d (from %s): %d batches per epoch",
                self.source.url, shard.rank, shard.world_size, shard_from, len(self.sampler),
            )  # fmt: skip
        self.epoch = 0
        self._live: Callable[[], Epoch | None] = lambda: None
        self._stats = Stats()
        self._progress = EpochProgress(0, len(self.sampler))  # of the live or last epoch
        self._cut = self.sampler  # how the live or last epoch was cut (``taken``: what a resumed world left out)
        # loaded by load_state_dict, used by the next iter(): the progress and the cut it counts in
        self._resume: tuple[EpochProgress, EpochSampler] | None = None

    @property
    def batch_size(self) -> int:
        return self.options.batch_size

    @property
    def concurrency(self) -> int | str:
        return self.options.concurrency

    def __len__(self) -> int:
        """Batches per epoch for this loader's shard (of the resumed epoch's cut, once a state is loaded)."""
        return len(self._resume[1] if self._resume is not None else self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next ``iter()`` yields (reshuffles with ``shuffle=True``).

        A resume point loaded with ``load_state_dict`` survives only ``set_epoch`` of its own epoch, so
        a training loop can call ``set_epoch(epoch)`` unconditionally after loading a checkpoint.
        """
        _check("epoch", epoch, isinstance(epoch, int) and epoch >= 0, "an int >= 0")
        if self._resume is not None and self._resume[0].epoch != epoch:
            self._resume = None
        self.epoch = epoch

    # -- resume ----------------------------------------------------------------------------------
    def _fingerprint(self) -> dict[str, Any]:
        """What must match for a saved state to mean the same epoch in this loader: its global order."""
        return order_of(self.sampler, dataset_of(self.source))

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch stands: the epoch and the batches the consumer has taken.

        Save it with the model's checkpoint; ``load_state_dict`` makes the next ``iter()`` yield exactly
        the batches not yet taken (in the same order when ``in_order``). Batches read ahead but not
        taken are not in the state: they are read again after a resume, never lost or repeated.

        The state is global: saved by any rank, it loads into every rank of any world size, with any
        batch size (``engine.consumed``), so rank 0 alone can checkpoint. It assumes what
        DistributedDataParallel guarantees: every rank has taken as many batches as this one. A few
        hundred bytes: the epoch's order (seed, length, version), the cut (world size, batch size, the
        ranges an earlier world had taken) and this shard's consumed batches (a count, and the few taken
        out of order).
        """
        progress, cut = self._resume if self._resume is not None else (self._progress, self._cut)
        if progress.epoch != self.epoch and self._live() is None:
            progress, cut = EpochProgress(self.epoch, len(self.sampler)), self.sampler
        return progress.to_dict(self._fingerprint(), cut_of(cut))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from ``state_dict()``: the next ``iter()`` continues that epoch where it stood.

        A state saved by a loader cut the same way (the same shard of the same world, the same batch
        size) resumes batch for batch. Any other (another world size, another rank's state, another
        batch size) resumes from the positions of the epoch's order the saver's world consumed: the rest
        is cut among this world's ranks, every row once (a pad of at most ``world_size - 1`` repeats with
        ``remainder="pad"``), and this loader's epoch has the batches of its share of that rest."""
        self._close_epoch()
        progress, cut = EpochProgress.from_dict(state, self._fingerprint(), self.source.url)
        progress, sampler = resume_cut(self.sampler, progress, cut)
        self._resume = (progress, sampler)
        self.epoch = progress.epoch

    def resume_positions(self, epoch: int, taken: Ranges) -> None:
        """Make the next ``iter()`` run ``epoch`` without the positions ``taken`` of its order (what a world
        before this one consumed), the rest cut among this loader's world as ``load_state_dict`` cuts it:
        how ``AsyncIterableDataset`` hands a rank's global resume point to each DataLoader worker."""
        self._close_epoch()
        sampler = dataclasses.replace(self.sampler, taken=merge(taken))
        self._resume = (EpochProgress(epoch, len(sampler)), sampler)
        self.epoch = epoch

    # -- epochs ----------------------------------------------------------------------------------
    def __iter__(self) -> Epoch:
        """Start the current epoch (or its rest, after ``load_state_dict``). A loader runs one epoch at
        a time: a previous iterator of it is closed."""
        self._close_epoch()
        progress, sampler = self._resume or (EpochProgress(self.epoch, len(self.sampler)), self.sampler)
        self._resume = None
        o = self.options
        it: Epoch
        if self.processes and self._isolated is None:
            if self._pool is None or self._pool.closed:  # the first epoch, or the last pool lost a worker
                self._pool = WorkerPool(
                    self.source, o, self.shard, self.processes, context=o.mp_context, timeout=o.shutdown_timeout,
                    sampler=self.sampler,
                )  # fmt: skip
            done = frozenset(j for j in range(len(sampler)) if progress.done(j))
            it = FanoutIterator(
                self._pool, self.epoch, skip=done, in_order=o.in_order, progress=progress, taken=sampler.taken
            )
        else:
            it = self._shard.iterate(self.epoch, progress, taken=sampler.taken)
            if self._isolated is not None:
                self._isolated.begin_epoch(it.stats())
        if self._board is not None:
            it.on_end = functools.partial(self._report_ranks, self.epoch)
        self._live = weakref.ref(it)
        self._stats = it.stats()
        self._stats.open_s = self._open_s
        self._progress, self._cut = progress, sampler
        return it

    def _report_ranks(self, epoch: int) -> None:
        """At an epoch's end, on every rank of the process group: post this rank's figures; on rank 0, name
        the slowest rank (``engine.slowest``: a few hundred bytes a rank, no collective)."""
        assert self._board is not None
        found = exchange(self._board, epoch, self.stats())
        if found is None:
            self._board = None
        elif found:
            self._ranks = found

    def stats(self) -> dict[str, Any]:
        """Figures of the current (or last) epoch, of this rank (``rank``): throughput, reads in flight,
        latency percentiles, skipped samples (with ``skipped_samples``: the first of them, index and cause),
        and where the time goes.

        Where the time goes (wall seconds, summed over the epoch's batches; stages overlap, so they do
        not add up to ``elapsed_s``): ``open_s`` (opening the source), ``read_s`` (store requests, node
        store hits included: ``node_hits``), ``decode_s``, ``augment_s`` (``augment=``), ``transform_s``,
        ``collate_s`` (the CPU pool, ``cpu_workers`` threads, busy ``cpu_busy_frac`` of the time),
        ``queue_s`` (batches ready, waiting for the consumer), ``step_s`` (the consumer between
        ``next()`` calls: the training step) and ``steady_wait_s`` (the consumer blocked in ``next()``,
        the first batch left out); ``consumer_wait_frac`` = steady_wait_s / (steady_wait_s + step_s).
        ``wait_on_<stage>_s`` splits that wait by what the batch waited for was doing (store, decode,
        augment, transform, collate, other). ``waiting_on``: "training" when the consumer waited under
        10 % of its time, else the stage it waited on most ("store", "decode", "augment", "transform",
        "collate"; "start" before the first batch); ``waiting_on_why`` says it in a sentence. The rule is
        ``engine.stats.verdict``'s.

        On rank 0 of a process group (a loader built on every rank), from the end of the first epoch:
        ``slowest_rank``, ``slowest_rank_waiting_on``, ``slowest_rank_wait_frac``, ``slowest_rank_elapsed_s``,
        ``ranks_elapsed_s`` (each rank's epoch), ``ranks_reported`` and ``ranks_not_finished`` (within
        ``engine.slowest.GRACE_S`` of rank 0's end) of the last epoch all ranks finished."""
        snap = self._stats.snapshot()
        snap.update(
            rank=self.shard.rank, concurrency_setting=self.options.concurrency, read_mode=self.read_mode,
            epoch=self.epoch,
            retries=self._shard.source.retry_count(),
            reader_start_s=self._isolated.start_s() if self._isolated is not None else None,
            skipped_samples=list(self._stats.skipped_samples),
        )  # fmt: skip
        snap.update(self._ranks)
        return snap

    def close(self) -> None:
        """Stop the live epoch, if any (threads joined), and the worker processes of ``processes=K``.
        The loader stays usable: a later ``iter()`` starts new workers. Garbage collection of the loader
        and interpreter exit stop the workers too (``fanout.WorkerPool``); the memory kept for batches to
        come is freed (``runtime.alloc``)."""
        self._close_epoch()
        self._shard.close()
        if self._pool is not None:
            self._pool.close()
        if self._isolated is not None:
            self._isolated.close()
        release_spares()

    def _close_epoch(self) -> None:
        """Stop the live epoch, if any; with ``processes=K`` its workers stay, idle, for the next one."""
        it = self._live()
        if it is not None:
            it.close()

    def __enter__(self) -> AsyncLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        o = self.options
        return (
            f"AsyncLoader({self.source!r}, batch_size={o.batch_size}, concurrency={o.concurrency}, "
            f"prefetch={o.prefetch}, read_mode={self.read_mode!r}, in_order={o.in_order})"
        )


def reader_for(source: Source[Any], o: LoaderOptions) -> IsolatedSource | None:
    """The reader process a loader of ``source`` with options ``o`` reads through (``processes="auto"`` on a
    source whose reads can crash this process: ``LoaderOptions.reader_processes``), or None where it reads in
    this process. Started now, not at the first epoch, so that its start and its open of the store overlap
    the checks here and whatever the training script does before its first batch; but a source whose open
    draws its rows and that does not describe itself, once opened here (``open_through``), so that the
    reader reads those rows."""
    pickled = _pickled(source) if o.reader_processes(source) and o.processes == "auto" else None
    if pickled is None:
        return None
    reader = IsolatedSource(
        source, needs_main=b"__main__" in pickled, max_restarts=o.max_restarts, timeout=o.shutdown_timeout,
        stall_timeout=o.stall_timeout, node_root=o.shared_reader_root(source),
    )  # fmt: skip
    if source.opens_alike or source.describes:
        reader.start(early=True)
    return reader


def open_through(source: Source[Any], reader: IsolatedSource | None) -> Source[Any]:
    """``source``, opened: by ``reader``'s open alone where it describes itself (``Description``: this process
    then never opens the store, nor imports Deep Lake), else here; then ``reader`` is started if it was not.
    A failure stops ``reader``."""
    try:
        if reader is not None and source.describes:
            reader.open()
        else:
            source.open()
        if reader is not None:
            reader.start()  # (started already, unless the open above drew the rows)
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    return source


def _pickled(source: Source[Any]) -> bytes | None:
    """``source`` pickled as a reader process will be given it, or None where it cannot be (one with a
    lambda or a local function in it). Then ``processes="auto"`` reads in this process and says so,
    rather than refusing what works without isolation."""
    from multiprocessing.reduction import ForkingPickler

    try:
        pickled = bytes(ForkingPickler.dumps(source))
    except Exception as exc:  # noqa: BLE001 - pickle raises several types for the same answer
        log.warning(
            "asyncload: %s is read in this process, not in a reader process (processes='auto'): the source cannot "
            "be pickled into one (%s: %s); define the source's class at module level to isolate its reads, or "
            "pass processes=0 to say this is intended",
            source.url, type(exc).__name__, exc,
        )  # fmt: skip
        return None
    if (unreachable := unreachable_from_main(pickled)) is not None:
        names, why, fix = unreachable
        log.warning(
            "asyncload: %s is read in this process, without crash isolation (processes='auto'): a reader process "
            "could not import %s from the script: %s. To keep Deep Lake's crashes out of training, %s; to say "
            "this is intended, pass processes=0",
            source.url, ", ".join(names), why, fix,
        )  # fmt: skip
        return None
    return pickled


__all__ = ["AsyncLoader", "Epoch", "EpochIterator", "LoaderOptions"]
