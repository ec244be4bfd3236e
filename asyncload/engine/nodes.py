"""How many nodes a world spans, and which blocks each node keeps: the node-stable epoch (``shuffle_scope``).

Why: with the node block store every node keeps what it fetched. If a rank's share of the dataset were a
new random set of blocks every epoch, every node would end up fetching, and keeping, nearly all of it: on
8 nodes × 8 GPUs and 200,000 rows, 6.25× the dataset fetched over 10 epochs, 78% of it on every node's
disk. Here each node keeps one part of the blocks for the whole run, so the dataset is fetched about once
across the cluster: each epoch shuffles the blocks within a node's part (``sampler.block_order``, as for
one node) and the node's ranks split it; every global batch still draws from every node's part, since each
rank reads its node's.

- **Which blocks**: rendezvous hashing with bounded loads. Each block has a score per node, a pure
  function of ``(seed, block, node)``, and goes to its highest-scoring node that still has room (parts
  are equal to one block). A node's scores do not depend on how many nodes there are, so a world resumed on
  another node count moves few blocks: the new node takes the blocks it scores highest, about ``1/N``.
- **Where in the order**: the epoch's order is the nodes' parts one after another, node ``j``'s at about
  ``j × n / N``: ranks take contiguous ranges of the order (``sampler``), and torchrun numbers a node's
  ranks together, so node ``j``'s ranks read node ``j``'s part (at a boundary, up to a block and a rank's
  pad fall to the neighbouring node).
- **Which nodes**: torchrun's environment (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` or
  ``NODE_RANK``, ``RANK``, ``LOCAL_RANK``). A world that is not torchrun's (explicit ``rank=``/``world_size=``
  of another size) is one node; an environment that contradicts itself is refused, never guessed.
- **Nodes of one size, or refused**: the parts are equal, so every node must run as many ranks. One rank
  cannot see another node's size: with ``LOCAL_WORLD_SIZE`` but no node number (a launcher that sets no
  ``GROUP_RANK``/``NODE_RANK``), nodes of 4, 2 and 2 ranks would each count other nodes (2 or 4) and read
  other orders, silently. So a node count needs the node's number, which makes a rank's own variables
  enough (``RANK = GROUP_RANK × LOCAL_WORLD_SIZE + LOCAL_RANK`` fails on the first node of another size);
  without it the world is read as one node. Where the ranks share a process group, ``ranks`` compares every
  rank's variables once (``world_verdict``), so that all of them raise one message naming each node's size.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping

import numpy as np

from ..errors import ConfigError
from ..runtime.log import log_once

_MASK = 0xFFFFFFFFFFFFFFFF
_SALT = 0x6E6F6465  # "node": the parts' scores are drawn apart from every epoch's order


#: The variables a rank's node is read from, in the order ``world_verdict`` receives them.
NODE_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "RANK", "LOCAL_RANK")


def node_count(world_size: int, env: Mapping[str, str] = os.environ) -> int:
    """The nodes a world of ``world_size`` ranks spans, from torchrun's variables in ``env`` (1 without them,
    or where they describe another world); ``ConfigError`` naming the variables where they contradict."""
    names = NODE_VARIABLES
    try:
        got = {k: int(env[k]) for k in names if env.get(k, "") != ""}
    except ValueError:
        bad = {k: env[k] for k in names if env.get(k, "") != "" and not env[k].strip().lstrip("-").isdigit()}
        raise ConfigError(f"torchrun's variables must be integers: {bad}") from None
    local, world = got.get("LOCAL_WORLD_SIZE"), got.get("WORLD_SIZE")
    group = got.get("GROUP_RANK", got.get("NODE_RANK"))
    if local is None:
        if group:  # a node's number without the size of a node: which ranks share it cannot be told
            raise ConfigError(
                f"GROUP_RANK/NODE_RANK={group} is set but LOCAL_WORLD_SIZE is not: set LOCAL_WORLD_SIZE (ranks per "
                f"node, as torchrun does), or unset both for a world read as one node"
            )
        return 1
    if world is None or local < 1 or world < 1 or world % local:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={local} with WORLD_SIZE={world}: a world of whole nodes needs WORLD_SIZE a multiple "
            f"of LOCAL_WORLD_SIZE (torchrun sets both)"
        )
    if group is None:  # the node's size alone: another node's may differ, unseen from here (module doc)
        log_once(
            "asyncload: LOCAL_WORLD_SIZE is set but neither GROUP_RANK nor NODE_RANK: the world is read as one node "
            "(shuffle_scope='node' keeps no node parts); set NODE_RANK to each node's number, as torchrun sets "
            "GROUP_RANK, to keep them",
            logging.INFO,
        )
        return 1
    rank, local_rank = got.get("RANK"), got.get("LOCAL_RANK")
    if None not in (rank, local_rank, group) and rank != group * local + local_rank:  # type: ignore[operator]
        raise ConfigError(
            f"RANK={rank} is not GROUP_RANK×LOCAL_WORLD_SIZE+LOCAL_RANK={group}×{local}+{local_rank}: either the "
            f"nodes run different numbers of ranks (this one {local}; shuffle_scope='node' needs nodes of one size) or "
            f"a node's ranks are not numbered together (torchrun numbers them so); set shuffle_scope='global' for "
            f"such a world"
        )
    return world // local if world == world_size else 1


def node_variables() -> tuple[str | None, ...]:
    """This rank's ``NODE_VARIABLES`` as set (None where unset), for ``world_verdict`` on every rank."""
    return tuple(os.environ.get(k) or None for k in NODE_VARIABLES)


def world_verdict(world_size: int, seen: list[tuple[str | None, ...]]) -> str | None:
    """What is wrong with a world whose rank ``r`` has the variables ``seen[r]``, one message the same on
    every rank (each computes it from everyone's variables); None where every rank counts the same nodes."""
    counts: list[int | str] = []
    for variables in seen:
        env = {k: v for k, v in zip(NODE_VARIABLES, variables, strict=True) if v is not None}
        try:
            counts.append(node_count(world_size, env))
        except ConfigError as exc:
            counts.append(str(exc))
    if all(c == counts[0] for c in counts) and all(isinstance(c, int) for c in counts):
        return None
    sizes: dict[str, list[int]] = {}
    for r, variables in enumerate(seen):
        named = dict(zip(NODE_VARIABLES, variables, strict=True))
        node = named["GROUP_RANK"] or named["NODE_RANK"] or "?"
        sizes.setdefault(f"node {node} (LOCAL_WORLD_SIZE={named['LOCAL_WORLD_SIZE']})", []).append(r)
    shown = "; ".join(f"{k}: ranks {v}" for k, v in sizes.items())
    return (
        f"the {len(seen)} ranks do not describe one world of equal nodes ({shown}); read from each rank's "
        f"{', '.join(NODE_VARIABLES)}, they would count nodes differently ({sorted(set(map(str, counts)))}) and "
        f"read other rows. shuffle_scope='node' needs every node to run as many ranks, numbered node by node: "
        f"launch nodes of one size, or set shuffle_scope='global'"
    )


@functools.lru_cache(maxsize=16)
def node_parts(n: int, block: int, seed: int, nodes: int) -> tuple[np.ndarray, ...]:
    """The blocks (ids, sorted) each of ``nodes`` nodes keeps, for every epoch (module doc)."""
    nb = -(-n // block)
    scores = np.stack([np.random.default_rng([seed & _MASK, _SALT, j]).random(nb) for j in range(nodes)], axis=1)
    room = [nb * (j + 1) // nodes - nb * j // nodes for j in range(nodes)]
    prefs = np.argsort(-scores, axis=1, kind="stable")
    owner = np.empty(nb, dtype=np.int64)
    for b in np.argsort(-scores.max(axis=1), kind="stable"):  # the blocks surest of their node first
        for j in prefs[b]:
            if room[j]:
                owner[b] = j
                room[j] -= 1
                break
    return tuple(np.flatnonzero(owner == j) for j in range(nodes))


__all__ = ["NODE_VARIABLES", "node_count", "node_parts", "node_variables", "world_verdict"]
