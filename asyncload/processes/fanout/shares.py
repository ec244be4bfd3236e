"""Who reads what: worker ``k`` of ``K`` serves a sub-shard of the parent's shard, chosen so that reading
the workers round-robin gives back the parent's batch sequence (see the package doc), and runs with its
share of the options, so that K workers together load the store as one process would."""

from __future__ import annotations

from ...engine.options import LoaderOptions
from ...engine.sampler import Shard


def _per_worker(options: LoaderOptions, processes: int) -> LoaderOptions:
    """One worker's options: in order (every message names its batch), no fan-out of its own, and its
    share of the samples in flight and of the byte budget, so that K workers together keep what one
    process would: the same memory bound, and no K-fold burst of reads when every worker starts an epoch
    at once."""
    share = {
        "max_concurrency": max(1, options.max_concurrency // processes),
        "memory_budget": max(1, options.budget_bytes // processes),
    }
    if options.concurrency != "auto":
        share["concurrency"] = max(1, int(options.concurrency) // processes)
    return options.replace(in_order=True, processes=0, **share)


def sub_shard(shard: Shard, k: int, processes: int) -> Shard:
    """The share of ``shard`` that worker ``k`` of ``processes`` serves: batches ``k, k + K, k + 2K, ...``
    of ``shard``'s sequence (see the package doc)."""
    return Shard(
        shard.rank, shard.world_size,
        worker=shard.worker + shard.num_workers * k, num_workers=shard.num_workers * processes,
    )  # fmt: skip
