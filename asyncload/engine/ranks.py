"""Every rank of a ``torch.distributed`` process group reads the same data, or none reads at all.

A loader cuts one epoch's order into equal shares, one per rank, computed in each rank from the same
numbers (``sampler``). That is exact only if every rank holds the same rows in the same order. A Deep Lake
``query=`` runs in each rank's own open (``DeepLakeSource``), so a query that draws its rows at random
(``SAMPLE BY``) or leaves their order open gives each rank other rows: silently, some rows would be read
by two ranks and others by none. The same goes for a dataset written to between the ranks' opens, or an
object-store prefix listed while objects were added.

So a loader that takes its shard from the process group compares, once, when it is built, what each rank
opened: ``Source.version`` (the commit, and for a query a digest of its rows in order; an object store's
keys), gathered from every rank (``all_gather_object``: a few dozen bytes). When they differ, every rank
raises the same ``RanksDisagreeError`` naming each rank's version, so that no rank goes on to wait for the
others in a collective. The same gather carries each rank's torchrun variables, so that a world of nodes of
different sizes is refused on every rank with one message (``nodes``). The check is a collective itself: it runs only where every rank builds the loader
(its shard from the process group), in the rank's own process (a DataLoader worker never builds one).
"""

from __future__ import annotations

import logging
from typing import Any

from ..errors import ConfigError, RanksDisagreeError
from ..sources.base import Source
from .nodes import node_variables, world_verdict

log = logging.getLogger("asyncload")


def check_ranks_agree(source: Source[Any], what: str = "loader", *, node_scope: bool = False) -> None:
    """Raise ``RanksDisagreeError`` on every rank when the ranks of the initialised process group opened
    different versions of ``source`` (see the module doc), and, with ``node_scope`` (a node-stable order),
    ``ConfigError`` on every rank when their torchrun variables describe nodes of different sizes or count
    the nodes differently (``nodes.world_verdict``); nothing without a process group of two or more."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (source.version, node_variables()))  # one collective for both checks
    versions = [v for v, _ in gathered]
    if node_scope and (wrong := world_verdict(dist.get_world_size(), [n for _, n in gathered])) is not None:
        raise ConfigError(wrong)
    if len(set(versions)) == 1:
        return
    shown = "; ".join(f"rank {r}: {v}" for r, v in enumerate(versions))
    err = RanksDisagreeError(
        f"the {dist.get_world_size()} ranks of the process group opened different data for this {what} "
        f"({source.url}): {shown}. Each rank would read its share of other rows, so rows would be read twice "
        f"or not at all. A query that samples (SAMPLE BY) or leaves the order open (no ORDER BY on a unique "
        f"key) draws other rows in each process: open the source on rank 0 and send it to the others "
        f"(torch.distributed.broadcast_object_list: an opened source carries its rows), or make the query "
        f"deterministic; and open the same version (version=) on every rank"
    )
    err.versions = dict(enumerate(versions))  # type: ignore[attr-defined]
    raise err
