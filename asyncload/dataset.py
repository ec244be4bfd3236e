"""``AsyncIterableDataset``: the loader as a ``torch.utils.data.IterableDataset``.

Use it with ``DataLoader(ds, batch_size=None, num_workers=N)``: the dataset already yields batches.

Why it is exact across workers and ranks: each DataLoader worker builds its own ``AsyncLoader`` in its
own process (the loop starts there, after any fork) over its own share of the epoch (see ``sampler``):
rank from ``torch.distributed`` when a process group is initialised, worker from
``get_worker_info()``. Batch ``k`` of a rank goes to worker ``k % num_workers``, and DataLoader reads
workers round-robin, so a rank sees the same batch sequence with 0, 1 or 8 workers.

A spawned worker has no process group: the rank is pinned when DataLoader pickles the dataset in the
rank's main process. The source is pickled as a description (URL, columns, credentials); each worker
opens the store itself.

Why the epoch lives in shared memory: a worker iterates its own *copy* of the dataset, made when the
worker starts. With ``persistent_workers=True`` that copy lives for the whole run, so an attribute set
in the main process (``set_epoch``, ``load_state_dict``) would never reach it and every epoch would
repeat the first one's order. The epoch and the resume point are therefore kept in a two-int tensor in
shared memory, which DataLoader passes to fork, spawn and forkserver workers alike; every ``__iter__``
reads it. Call ``set_epoch(e)`` before each epoch, as with ``DistributedSampler``.

Two forms of resume state:
- **explicit**, for plain DataLoader loops: the training loop counts its steps anyway, so
  ``state_dict(batches_consumed=k)`` records the epoch and that count; after ``load_state_dict`` the
  rank's remaining batches are dealt to the workers from worker 0 again, which is what a new DataLoader
  iterator expects, and the resumed loop yields exactly the batches it had not, in the same order.
  The state is global: every rank of the saver's world took ``k`` batches (DistributedDataParallel keeps
  them in step), so rank 0 alone saves it, and every rank of any world size loads it. In the world that
  saved it, each rank resumes after its ``k`` batches; in another, the positions of the epoch's order that
  the old world consumed are left out and the rest is cut among the new ranks (``engine.consumed``),
  every row once; that resumed epoch is shorter (``len()``), and ``batches_consumed`` counts its batches.
  The positions left out travel to the workers with the epoch, in the same shared memory.
- **the torchdata ``Stateful`` protocol**, for ``StatefulDataLoader``: ``state_dict()`` with no argument
  is the state of the iterator live *in this process* (each worker's own share), and
  ``load_state_dict`` of such a state makes this process's next iterator continue it. StatefulDataLoader
  calls both inside each worker and keeps the round-robin position itself.
Both carry the dataset's version; a state never resumes on other data.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import torch
import torch.utils.data

from .engine.consumed import cut_of, order_of, resume_cut
from .engine.epoch import Epoch
from .engine.mixing import mixed_order
from .engine.options import LoaderOptions
from .engine.progress import DATASET_KEYS, EpochProgress, check_dataset, check_dataset_version, dataset_of
from .engine.ranks import check_ranks_agree
from .engine.sampler import EpochSampler, Ranges, Remainder, Shard, distributed_rank_world
from .engine.slowest import RankBoard, exchange
from .engine.stats import ROW, Stats, row, summed
from .errors import ConfigError, portable
from .loader import AsyncLoader, open_through, reader_for
from .runtime.log import log_once_forked
from .sources.base import Source

log = logging.getLogger("asyncload")

#: DataLoader workers whose figures ``stats()`` sums, each a row of a shared table (worker ``id % MAX_WORKERS``).
MAX_WORKERS = 64
#: Seconds between a worker's writes of its figures to that table (and at the end of its epoch).
FIGURES_EVERY_S = 0.2

RANK_STATE_VERSION = 3  # 2: names the dataset's version; 3: the epoch's order and the cut, for any world

#: Ranges of an epoch's order consumed by earlier worlds that the shared cell holds (``_cell``): each world
#: adds at most one per rank, and touching ones merge.
MAX_TAKEN = 512


class AsyncIterableDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """Batches of ``source`` for ``DataLoader(..., batch_size=None)``; options as ``AsyncLoader``.

    ``rank``/``world_size`` default to the initialised ``torch.distributed`` process group (or 0/1).
    ``remainder`` ("pad" or "drop") says what happens when ranks do not divide the dataset, so that every
    rank yields the same number of batches.
    """

    def __init__(
        self,
        source: Source[Any],
        batch_size: int = 32,
        *,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        remainder: Remainder = "pad",
        rank: int | None = None,
        world_size: int | None = None,
        **loader_options: Any,
    ) -> None:
        super().__init__()
        if not isinstance(source, Source):
            raise ConfigError(f"source={source!r} is not allowed: pass a Source such as DeepLakeSource(url)")
        # Validated now, in the constructing process, so that mistakes surface before workers start; the
        # source is opened for the same reason (a missing dataset or column fails here, not in a worker).
        self.options = LoaderOptions.of(
            dict(
                batch_size=batch_size,
                shuffle=shuffle,
                seed=seed,
                drop_last=drop_last,
                remainder=remainder,
                **loader_options,
            )
        )
        if self.options.decode.startswith("cuda"):  # a named error here, not in a worker at its first batch
            from .image.gpu import require_torchvision

            require_torchvision(self.options.decode)
        # Opened by a reader process where the source describes itself (Deep Lake: ``loader.reader_for``), which
        # is stopped once it has said what it opened: this process, which DataLoader forks into its workers,
        # then holds no Deep Lake runtime (which does not survive a fork), starts none of its threads and
        # imports none of it. Each worker's loader reads through a reader of its own, or the node's.
        reader = reader_for(source, self.options) if source.describes else None
        try:
            self.source = open_through(source, reader)
        finally:
            if reader is not None:
                reader.close()
        if rank is None and world_size is None:  # the shard comes from the process group (``engine.ranks``)
            check_ranks_agree(
                self.source, "dataset", node_scope=self.options.shuffle and self.options.shuffle_scope == "node"
            )
        self.rank = rank
        self.world_size = world_size
        # [epoch, rank batches of that epoch already consumed, ranges taken by earlier worlds, the ranges]:
        # shared with every worker (module doc).
        self._cell = torch.zeros(3 + 2 * MAX_TAKEN, dtype=torch.int64).share_memory_()
        # each DataLoader worker's figures (``engine.stats.row``), summed by ``stats()`` in this process
        self._figures = torch.zeros((MAX_WORKERS, ROW), dtype=torch.float64).share_memory_()
        self._pending: dict[str, Any] | None = None  # a Stateful state for this process's next iterator
        self._here: AsyncLoader | None = None  # the loader of this process's latest iterator
        # where this rank posts its epochs' figures, and rank 0 reads every rank's (``engine.slowest``)
        self._board = RankBoard.of_process_group() if rank is None and world_size is None else None
        self._reported = -1  # the last epoch posted
        self._ranks: dict[str, Any] = {}  # rank 0: the slowest rank of the last epoch reported

    # -- the epoch, shared with workers --------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return int(self._cell[0])

    @property
    def _start(self) -> int:
        return int(self._cell[1])

    @property
    def _taken(self) -> Ranges:
        k = int(self._cell[2])
        flat = self._cell[3 : 3 + 2 * k].tolist()
        return tuple((flat[2 * j], flat[2 * j + 1]) for j in range(k))

    def _set(self, epoch: int, start: int, taken: Ranges | None = None) -> None:
        if taken is not None:
            if len(taken) > MAX_TAKEN:
                raise ConfigError(
                    f"a resume state with {len(taken)} ranges of consumed rows is not allowed: at most {MAX_TAKEN} "
                    f"(start the epoch afresh)"
                )
            flat = [v for r in taken for v in r]
            self._cell[3 : 3 + len(flat)] = torch.tensor(flat, dtype=torch.int64)
            self._cell[2] = len(taken)
        self._cell[1] = start
        self._cell[0] = epoch

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch that the next iteration yields, in this process and in every DataLoader
        worker, persistent ones included (call it before creating the DataLoader iterator). A resume
        point survives only ``set_epoch`` of its own epoch."""
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise ConfigError(f"epoch={epoch!r} is not allowed: an int >= 0")
        if self._board is not None and epoch != self.epoch and self.stats().get("batches_yielded"):
            self.report_ranks()  # the epoch that ends here, unless the Lightning callback did at its end
        if epoch == self.epoch:
            self._set(epoch, self._start)
        else:
            self._set(epoch, 0, ())

    # -- resume ----------------------------------------------------------------------------------------
    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """The resume point.

        ``state_dict(batches_consumed=k)``: after this rank's training loop took ``k`` batches of the
        current epoch (counted from the epoch's start, including those before an earlier resume).

        ``state_dict()``: the torchdata ``Stateful`` form, the position of the iterator live in *this*
        process (what ``StatefulDataLoader`` saves from each worker, or from the main process with
        ``num_workers=0``).
        """
        if batches_consumed is None:
            if self._here is None:
                raise ConfigError(
                    "state_dict() without batches_consumed reports the iterator of this process, and none has "
                    "run here (DataLoader workers iterate in their own processes): pass batches_consumed=<steps "
                    "taken this epoch>, or use torchdata's StatefulDataLoader, which asks each worker"
                )
            return {"form": "iterator", **self._here.state_dict()}
        total = self._rank_batches()
        if not 0 <= batches_consumed <= total:
            raise ValueError(
                f"batches_consumed={batches_consumed} is not allowed: 0..{total} (batches in this rank's epoch)"
            )
        return {
            "form": "rank", "version": RANK_STATE_VERSION, "epoch": self.epoch, "batches_consumed": batches_consumed,
            "rank_batches": total, "dataset_version": self.source.version, "plan": self._order(),
            "cut": cut_of(self._rank_sampler()),
        }  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue ``state``'s epoch after the batches it had consumed.

        A ``state_dict(batches_consumed=k)`` state applies to the next DataLoader iterator in every
        worker (persistent ones too); a ``state_dict()`` state to the next iterator of this process.
        """
        if not isinstance(state, dict):
            raise ConfigError(f"state={state!r} is not allowed: a dict from state_dict()")
        if state.get("form") == "iterator":
            self._pending = dict(state)
            return
        if state.get("version") not in (2, RANK_STATE_VERSION) or "batches_consumed" not in state:
            raise ConfigError(
                f"state {state!r} is not allowed: a dict from state_dict(batches_consumed=...) of version "
                f"{RANK_STATE_VERSION} (or 2), or from state_dict()"
            )
        epoch, k = int(state["epoch"]), int(state["batches_consumed"])
        if state["version"] == 2:  # saved before states were global: the same world only
            check_dataset_version(state.get("dataset_version"), self.source.version, self.source.url)
            total = self._rank_batches(())
            if state.get("rank_batches") != total:
                raise ConfigError(
                    f"state has rank_batches={state.get('rank_batches')!r}, this dataset {total}: it was saved "
                    f"with other options, dataset length or world size"
                )
            self._pending = None
            self._set(epoch, k, ())
            return
        order = self._order()
        check_dataset(state["plan"], order, self.source.url)
        for key, value in order.items():
            if key not in DATASET_KEYS and state["plan"].get(key) != value:
                raise ConfigError(
                    f"state was saved with {key}={state['plan'].get(key)!r}, but this dataset has {key}={value!r}; "
                    f"a resumed epoch must have the same order"
                )
        base, cut = self._rank_sampler(()), dict(state["cut"])
        mine = cut_of(base)["shard"]
        if isinstance(cut.get("shard"), list) and cut["shard"][1:] == mine[1:]:  # any rank of this world saved:
            cut["shard"] = mine  # every rank took as many batches, so each resumes after its own ``k``
        progress, rest = resume_cut(base, EpochProgress(epoch, int(state["rank_batches"]), k), cut)
        self._pending = None
        self._set(epoch, progress.next, rest.taken)

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader pickles the dataset in the main process for spawn/forkserver workers, where no
        # process group exists: pin this rank's place in the world now. (Forked workers inherit it.)
        state = self.__dict__.copy()
        state["_here"] = None
        state["_board"] = None  # the process group's store is this process's: workers post nothing
        rank, world = distributed_rank_world()
        if state["rank"] is None:
            state["rank"] = rank
        if state["world_size"] is None:
            state["world_size"] = world
        return state

    def shard(self) -> Shard:
        """The share of the epoch this process serves: rank × DataLoader worker."""
        rank, world = distributed_rank_world()
        rank = self.rank if self.rank is not None else rank
        world = self.world_size if self.world_size is not None else world
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return Shard(rank=rank, world_size=world, worker=worker, num_workers=workers)

    def _order(self) -> dict[str, Any]:
        """What fixes the epoch's global order (as ``AsyncLoader`` saves it)."""
        return order_of(self._rank_sampler(()), dataset_of(self.source))

    def _rank_sampler(self, taken: Ranges | None = None) -> EpochSampler:
        """This rank's cut of the epoch (its DataLoader workers together), less ``taken`` (default: what
        the shared cell says earlier worlds took)."""
        s = self.shard()
        sampler = self.options.sampler(
            len(self.source), Shard(s.rank, s.world_size), self.source.block_rows, mix=mixed_order(self.source)
        )
        return dataclasses.replace(sampler, taken=self._taken if taken is None else taken)

    def _rank_batches(self, taken: Ranges | None = None) -> int:
        return self._rank_sampler(taken).rank_batches

    def __len__(self) -> int:
        """Batches in this rank's epoch, summed over its DataLoader workers. Also after a mid-epoch
        ``load_state_dict``: like ``StatefulDataLoader`` and Lightning, which count a resumed epoch's
        steps from where it stood, and like LR schedules sized ``epochs * len(loader)``."""
        return self._rank_batches()

    def __iter__(self) -> Epoch:
        pending, self._pending = self._pending, None
        taken: Ranges = ()
        if pending is not None:  # a Stateful state: its own epoch and the deal it was cut with
            cut = pending.get("cut", pending.get("plan", {}))
            epoch, start = int(pending.get("epoch", 0)), int(cut.get("start", 0))
        else:
            epoch, start, taken = self.epoch, self._start, self._taken
        shard = self.shard()
        # DataLoader workers share the byte budget as fan-out workers do: N workers hold what one would
        budget = max(1, self.options.budget_bytes // shard.num_workers)
        options = self.options.replace(start_batch=start, memory_budget=budget)
        # (before the loader, which may open the source in this worker)
        forked_open = not self.source.fork_safe and self.source.opened_elsewhere()
        try:
            loader = AsyncLoader(self.source, shard=shard, options=options)
        except Exception as exc:
            if torch.utils.data.get_worker_info() is None:
                raise
            return _NotStarted(exc)  # (a worker: through next(), see _NotStarted)
        loader.set_epoch(epoch)
        if pending is not None:
            loader.load_state_dict(pending)
        elif taken:
            loader.resume_positions(epoch, taken)
        self._here = loader
        it = iter(loader)
        if torch.utils.data.get_worker_info() is not None:
            if forked_open:
                log_once_forked(  # once in all, not once per forked worker per epoch
                    f"fork {self.source.url}",
                    f"asyncload: DataLoader worker (pid {os.getpid()}) was forked from a process that had opened "
                    f"{self.source.url}; Deep Lake's runtime does not survive fork reliably (workers have segfaulted): "
                    "pass multiprocessing_context='spawn' or 'forkserver' to the DataLoader (said once for all the "
                    "forked workers)",
                )
            info = torch.utils.data.get_worker_info()
            return _WorkerEpoch(it, self._figures[info.id % MAX_WORKERS].numpy(), epoch)
        return it

    def stats(self, wait_s: float | None = None, step_s: float | None = None) -> dict[str, Any]:
        """The figures of this rank's latest epoch (as ``AsyncLoader.stats()``), summed over its DataLoader
        workers, with ``waiting_on`` decided from the sums.

        Each worker writes its figures to shared memory every ``FIGURES_EVERY_S`` seconds and at the end
        of its epoch, so a live figure lags by at most that. The consumer figures (``steady_wait_s``,
        ``step_s``) are the workers' own: a worker waits in the loader's ``next()`` when the pipeline is
        slow, and between batches while DataLoader's prefetch is full, i.e. at the training loop's pace.
        ``wait_s`` and ``step_s``, when given, are the training loop's own in this process (seconds
        blocked on the DataLoader, seconds in training steps, the first batch left out; the Lightning
        callback passes them) and replace the workers' in the verdict. With ``num_workers=0``: the
        figures of the loader iterating here."""
        st = summed(self._figures.numpy())
        if st is None and self._here is not None:
            st = self._here._stats
        if st is None:
            st = Stats()
        if wait_s is not None:
            st.steady_wait_s = wait_s
        if step_s is not None:
            st.step_s = step_s
        snap = st.snapshot()
        snap.update(rank=self.shard().rank, epoch=self.epoch)
        snap.update(self._ranks)
        return snap

    def report_ranks(self, wait_s: float | None = None, step_s: float | None = None) -> None:
        """Post this rank's figures of the current epoch (``stats(wait_s, step_s)``), once; on rank 0, read
        every rank's and name the slowest in ``stats()`` and a log line (``engine.slowest``). Called at
        ``set_epoch`` of the next epoch and by ``AsyncLoadCallback`` at each epoch's end; every rank of the
        process group must call it for the same epochs. Nothing without a process group."""
        board, epoch = self._board, self.epoch
        if board is None or epoch == self._reported:
            return
        self._reported = epoch
        found = exchange(board, epoch, self.stats(wait_s, step_s))
        if found is None:
            self._board = None
        elif found:
            self._ranks = found

    def close(self) -> None:
        """Stop the epoch this process is iterating, if any (``DataLoader(num_workers=0)`` iterates here;
        a worker's epoch stops with its process): a consumer waiting in ``next()`` on another thread gets
        ``LoaderClosedError``, never a ``StopIteration`` that would pass for the epoch's end."""
        here = self._here
        if here is not None:
            here.close()


class _WorkerEpoch(Epoch):
    """An epoch iterated inside a DataLoader worker: every exception leaves in a form that pickles.

    DataLoader sends a worker's exception class to the main process by pickle; a class that does not
    pickle is dropped on the way and the epoch simply ends short. ``portable`` makes that impossible.
    """

    def __init__(self, it: Epoch, figures: Any, epoch: int) -> None:
        self._it = it
        self._progress = it.state()
        self._stats = it.stats()
        self._figures = figures  # this worker's row of ``AsyncIterableDataset._figures`` (a NumPy view)
        self._epoch = epoch
        self._shown = 0.0  # when the row was last written (``perf_counter``)

    def _show(self) -> None:
        """Write this worker's figures to its row, for ``AsyncIterableDataset.stats()`` in the main process."""
        self._figures[:] = row(self._stats, self._epoch)
        self._shown = time.perf_counter()

    def __next__(self) -> Any:
        try:
            batch = next(self._it)
            if time.perf_counter() - self._shown >= FIGURES_EVERY_S:
                self._show()
            return batch
        except StopIteration:
            self._show()
            raise
        except BaseException as exc:
            self._show()
            carried = portable(exc)
            if carried is exc:
                raise
            raise carried from None

    def __len__(self) -> int:
        return len(self._it)

    def close(self) -> None:
        self._it.close()
        self._show()


class _NotStarted(Epoch):
    """A DataLoader worker's epoch that could not start: its source did not open in the worker (a store
    down for a moment: ``S3EndpointError``). The error leaves through the first ``next()``, which DataLoader
    carries to the training loop as the epoch's error (a retried epoch opens again). Raised by ``iter()``,
    it ended the worker process inside DataLoader's own set-up, where a persistent DataLoader waited for
    that worker for ever (seen in the soak, ``benchmarks/suites/soak.py``)."""

    def __init__(self, exc: Exception) -> None:
        self._exc = exc
        self._progress = EpochProgress(0, 0)
        self._stats = Stats()

    def __next__(self) -> Any:
        raise portable(self._exc)

    def __len__(self) -> int:
        return 0

    def close(self) -> None:
        pass


__all__ = ["AsyncIterableDataset"]
