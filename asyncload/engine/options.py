"""``LoaderOptions``: how a loader reads, as one frozen, validated value.

Why one object: the loader, the torch adapter and every fan-out worker build their epochs from the same
settings. Validated once where the user wrote them (with the messages ``config`` gives every setting:
``prefetch=0 is not allowed: an int >= 1``), then passed around whole and pickled into worker processes,
so no copy of the rules lives anywhere else and no throwaway loader is built just to check them.

What is *not* here: the source (what to read) and the shard (which share of it), which differ between the
processes that share one set of options.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import multiprocessing
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from ..image.augment import Augment, Op
from ..image.normalize import ModelReady
from ..runtime.log import log_once
from ..runtime.loop import LoopKind
from ..runtime.settings import setting, validate
from ..runtime.sizes import parse_size
from ..sources.base import Source
from .collate import RAGGED, CollateFn, RaggedSpec, Transform
from .nodes import node_count
from .sampler import EpochOrder, EpochSampler, Remainder, Shard, one_mix

ReadMode = Literal["auto", "row", "column"]
OnError = Literal["raise", "skip"]
MpContext = Literal["spawn", "forkserver"]


def _decode_ok(v: Any) -> bool:
    return v in ("auto", "cpu", "store", "cuda") or (isinstance(v, str) and v.startswith("cuda:") and v[5:].isdigit())


def _size_ok(v: Any) -> bool:
    if v == "auto":
        return True
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return v >= 1
    try:
        return isinstance(v, str) and parse_size(v) >= 1
    except ValueError:
        return False


def _ragged_ok(v: Any) -> bool:
    if v is None or isinstance(v, str):
        return v is None or v in RAGGED
    return all(isinstance(k, str) and p in RAGGED for k, p in v.items())


@dataclass(frozen=True)
class LoaderOptions:
    """Every setting of ``AsyncLoader`` but the source and the shard; see ``AsyncLoader`` for each."""

    batch_size: int = setting(32, "an int >= 1", lambda v: v >= 1)
    shuffle: bool = False
    shuffle_block: int | Literal["auto"] = setting(
        "auto", "'auto' or an int >= 1 (1: a full shuffle)", lambda v: v == "auto" or v >= 1
    )
    shuffle_window: int = setting(4096, "an int >= 1 (rows)", lambda v: v >= 1)
    shuffle_scope: Literal["node", "global"] = setting("node", "'node' or 'global'")
    seed: Any = setting(0, "an int", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool))
    concurrency: int | Literal["auto"] = setting("auto", "'auto' or an int >= 1", lambda v: v == "auto" or v >= 1)
    max_concurrency: int = setting(512, "an int >= 1", lambda v: v >= 1)
    prefetch: int = setting(4, "an int >= 1", lambda v: v >= 1)
    in_order: bool = True
    drop_last: bool = False
    transform: Transform | None = setting(None, "None or a callable")
    collate_fn: CollateFn | None = setting(None, "None or a callable")
    ragged: RaggedSpec = setting(None, "None, 'list', 'pad' or a dict of column -> 'list' | 'pad'", _ragged_ok)
    read_mode: ReadMode = setting("auto", "'auto', 'row' or 'column'")
    request_size: int | None = setting(None, "None or an int >= 1", lambda v: v is None or v >= 1)
    with_index: bool = True
    on_error: OnError = setting("raise", "'raise' or 'skip'")
    remainder: Remainder = setting("pad", "'pad' or 'drop'")
    start_batch: int = setting(0, "an int >= 0", lambda v: v >= 0)
    cpu_workers: int | None = setting(None, "an int >= 1", lambda v: v is None or v >= 1)
    loop: LoopKind = setting("auto", "'auto', 'uvloop' or 'asyncio'")
    shutdown_timeout: float = setting(10.0, "a number of seconds > 0", lambda v: v > 0)
    stall_timeout: float = setting(120.0, "a number of seconds > 0", lambda v: v > 0)
    cache: bool | Literal["auto"] = setting("auto", "'auto', True or False", lambda v: v in ("auto", True, False))
    cache_dir: str | None = setting(
        None, "None or a directory path", lambda v: v is None or isinstance(v, (str, os.PathLike))
    )
    cache_limit: int | str = setting(
        "auto",
        "'auto' or a number of bytes >= 1 (an int, or a size such as '50GB' (10^9) or '50GiB' (2^30))",
        _size_ok,
    )
    log_every: float | None = setting(None, "None or seconds > 0", lambda v: v is None or v > 0)
    hedge: float | None = setting(3.0, "None or a factor > 1", lambda v: v is None or v > 1)
    decode: str = setting("auto", "'auto', 'cpu', 'store', 'cuda' or 'cuda:N'", _decode_ok)
    augment: Augment | Sequence[Op] | Op | None = setting(
        None, "None or a list of Resize, RandomResizedCrop and RandomHorizontalFlip"
    )
    memory_budget: int | str = setting(
        "auto",
        "'auto' or a number of bytes >= 1 (an int, or a size such as '500MB' (10^6) or '2GiB' (2^30))",
        _size_ok,
    )
    processes: int | Literal["auto"] = setting(
        "auto", "'auto' or an int >= 0 (0: read in this process)", lambda v: v == "auto" or v >= 0
    )
    max_restarts: int = setting(3, "an int >= 0", lambda v: v >= 0)
    shared_reader: bool = True
    mp_context: MpContext = setting(
        "forkserver", "'spawn' or 'forkserver' (never 'fork': Deep Lake and event loops do not survive it)"
    )
    # Model-ready image columns (``normalize``): checked together by ``ModelReady.of``.
    normalize: Any = setting(None, "None or (mean, std): a number, or one per channel, each")
    layout: Any = setting("NHWC", "'NHWC' or 'NCHW'")
    dtype: Any = setting(None, "None, torch.float32, torch.float16 or torch.bfloat16")

    def __post_init__(self) -> None:
        validate(self)
        if isinstance(self.ragged, Mapping):  # frozen and hashable-free: keep a private copy
            object.__setattr__(self, "ragged", dict(self.ragged))
        if self.decode.startswith("cuda") and self.processes not in (0, "auto") and (self.transform or self.collate_fn):
            raise ConfigError(
                f"decode={self.decode!r} with processes={self.processes} is not allowed with a transform or "
                "collate_fn: the workers ship stored bytes and the training process decodes; use processes=0"
            )
        ready = ModelReady.of(self.normalize, self.layout, self.dtype)  # ConfigError naming the setting
        if ready is not None and (self.transform or self.collate_fn):
            given = [f"{k}={getattr(self, k)!r}" for k, d in (("normalize", None), ("layout", "NHWC"), ("dtype", None))
                     if getattr(self, k) != d]  # fmt: skip  # only what the user set, not the defaults
            raise ConfigError(
                f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} not allowed with a transform or "
                "collate_fn: model-ready settings apply to the default batch; normalize in your collate_fn"
            )
        if isinstance(self.normalize, Sequence) and len(self.normalize) == 2:  # lists (YAML) kept as tuples
            object.__setattr__(self, "normalize", (tuple(self.normalize[0]), tuple(self.normalize[1])))
        if self.augment is not None and not isinstance(self.augment, Augment):
            object.__setattr__(self, "augment", Augment(self.augment))  # validated: names the op that is wrong

    @property
    def budget_bytes(self) -> int:
        """``memory_budget`` in bytes: ``"auto"`` is 1 GiB, or an eighth of this machine's memory where
        that is less."""
        if self.memory_budget != "auto":
            return parse_size(self.memory_budget)
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = 8 << 30
        return min(1 << 30, total // 8)

    @property
    def cache_bytes(self) -> int | None:
        """``cache_limit`` in bytes; None for ``"auto"`` (the node store's default)."""
        return None if self.cache_limit == "auto" else parse_size(self.cache_limit)

    def wants_cache(self, source: Source[Any]) -> bool:
        """Whether ``source`` is read through the node block store: ``cache=True``, or ``"auto"`` and the
        source is remote."""
        return self.cache is True or (self.cache == "auto" and not source.local)

    def shared_reader_root(self, source: Source[Any]) -> Path | None:
        """Where the node's shared reader of ``source`` is found (``processes.nodereader``): the node
        store's root, where ``shared_reader`` is on and ``source`` is read through the store; else None."""
        if not (self.shared_reader and self.wants_cache(source)):
            return None
        from ..nodestore import default_root

        return Path(self.cache_dir).expanduser() if self.cache_dir is not None else default_root()

    @property
    def cpu_pool(self) -> int:
        """Threads of the loop's CPU pool (decode, transform, collate): ``cpu_workers``, or one per core
        this process may run on (decoding releases the GIL and scales with cores), at least 2."""
        from ..runtime.loop import cores_available

        return self.cpu_workers or max(2, cores_available())

    def reader_processes(self, source: Source[Any]) -> int:
        """Worker processes that read ``source``: ``processes``, or with ``"auto"`` one reader process for a
        source whose native reads can crash the process that runs them (``Source.isolate_reads``: Deep
        Lake), so that a crash costs a restarted reader, not the training run. Inside a daemonic process (a
        DataLoader worker), which may not start children: 1 where the node's shared reader reads for it
        (``shared_reader_root``: it is no child of the worker's); else 0, the worker itself the isolation,
        whose death DataLoader reports."""
        if self.processes != "auto":
            return int(self.processes)
        if not source.isolate_reads:
            return 0
        if multiprocessing.current_process().daemon:
            if self.shared_reader_root(source) is not None:  # not a child of this worker's (``nodereader``)
                return 1
            log_once(
                f"asyncload: {source.url} is read in this daemonic process (pid {os.getpid()}, a DataLoader worker): "
                "it cannot start a reader process, so a crash of a native read ends this worker and DataLoader "
                "raises it in the training process",
                logging.INFO,
            )
            return 0
        return 1

    @property
    def model_ready(self) -> ModelReady | None:
        """``normalize``, ``layout`` and ``dtype`` as one value (None: uint8 NHWC, as decoded)."""
        return ModelReady.of(self.normalize, self.layout, self.dtype)

    def sampler(self, n: int, shard: Shard, block_rows: int = 1, mix: EpochOrder | None = None) -> EpochSampler:
        """The plan of epochs these options cut for ``shard`` of ``n`` rows; ``block_rows``: the source's
        ``Source.block_rows``, what ``shuffle_block="auto"`` takes, unless the dataset is so small that its
        block order would be one mix of all its rows (``sampler.one_mix``): then blocks buy no locality, and
        a full shuffle reads the first batch without first reading every block. ``mix``: the source's own
        order of each epoch, where it composes one (``MixedSource``)."""
        block = block_rows if self.shuffle_block == "auto" else int(self.shuffle_block)
        if self.shuffle_block == "auto" and one_mix(n, block, self.shuffle_window):
            block = 1
        nodes = node_count(shard.world_size) if self.shuffle and mix is None and self.shuffle_scope == "node" else 1
        return EpochSampler(
            n, self.batch_size, shuffle=self.shuffle, seed=self.seed, drop_last=self.drop_last,
            remainder=self.remainder, shard=shard, start=self.start_batch, block=block,
            window=self.shuffle_window, mix=mix, nodes=nodes,
        )  # fmt: skip

    @classmethod
    def of(cls, settings: Mapping[str, Any], base: LoaderOptions | None = None) -> LoaderOptions:
        """Options from keyword arguments (on top of ``base``). An unknown name is refused with the
        nearest known one: a misspelt setting must never be silently ignored."""
        names = tuple(cls.__dataclass_fields__)
        for name in settings:
            if name not in names:
                near = difflib.get_close_matches(name, names, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ConfigError(f"{name}={settings[name]!r} is not allowed: no such option{hint}")
        if base is None:
            return cls(**settings)
        return base.replace(**settings) if settings else base

    def replace(self, **changes: Any) -> LoaderOptions:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


__all__ = ["LoaderOptions", "MpContext", "OnError", "ReadMode"]
