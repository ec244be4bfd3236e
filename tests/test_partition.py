"""Node-stable epochs (``engine.nodes``, ``shuffle_scope="node"``): on several nodes each node reads the same
part of the blocks every epoch, shuffled within it, so that the cluster fetches the dataset about once;
every row once per epoch across the world, equal batches per rank, one node's order unchanged, resume on
another number of nodes exact, few blocks moved when the node count changes, torchrun's variables checked."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from asyncload import AsyncLoader, ConfigError
from asyncload.engine.nodes import NODE_VARIABLES, node_count, node_parts, world_verdict
from asyncload.engine.sampler import EpochSampler, Shard, block_order

from .sources import Rows

pytestmark = pytest.mark.timeout(60)

N, BLOCK, WINDOW, BATCH = 1000, 8, 64, 10


def world(
    nodes: int, per_node: int, epoch: int, workers: int = 1, n: int = N
) -> dict[tuple[int, int], list[list[int]]]:
    """Every shard's batches of ``epoch`` in a world of ``nodes`` × ``per_node`` ranks."""
    out = {}
    for rank in range(nodes * per_node):
        for w in range(workers):
            s = EpochSampler(n, BATCH, shuffle=True, seed=7, shard=Shard(rank, nodes * per_node, w, workers),
                             block=BLOCK, window=WINDOW, nodes=nodes)  # fmt: skip
            out[(rank, w)] = s.batches(epoch)
    return out


@pytest.mark.parametrize(("nodes", "per_node", "workers"), [(2, 1, 1), (2, 2, 2), (3, 2, 1), (4, 3, 2), (8, 2, 1)])
def test_every_row_once_per_epoch_and_equal_batches_per_rank(nodes, per_node, workers) -> None:
    w = nodes * per_node
    for epoch in range(3):
        shards = world(nodes, per_node, epoch, workers)
        seen = Counter(i for b in shards.values() for batch in b for i in batch)
        assert set(seen) == set(range(N))
        assert sum(seen.values()) - N == -(-N // w) * w - N  # the pad, and nothing else, comes twice
        per_rank = {r: sum(len(b) for (rr, _), b in shards.items() if rr == r) for r in range(w)}
        assert len(set(per_rank.values())) == 1
        assert world(nodes, per_node, epoch, workers) == shards  # the same order for the same seed


def node_rows(nodes: int, per_node: int, epoch: int) -> list[set[int]]:
    shards = world(nodes, per_node, epoch)
    return [
        {i for (r, _), b in shards.items() if r // per_node == j for batch in b for i in batch} for j in range(nodes)
    ]


def test_a_node_reads_the_same_part_every_epoch_and_every_batch_draws_from_every_part() -> None:
    first = node_rows(4, 2, 0)
    for epoch in (1, 2, 5):
        now = node_rows(4, 2, epoch)
        for j in range(4):
            assert now[j] == first[j], (epoch, j)  # the same rows every epoch (a boundary block shared, fixed)
    parts = [set((node_parts(N, BLOCK, 7, 4)[j][:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)) for j in range(4)]
    shards = world(4, 2, 3)
    for k in range(len(shards[(0, 0)])):  # the k-th global batch: one batch of every rank
        step = [i for (r, _), b in shards.items() for i in b[k]]
        assert all(any(i in part for i in step) for part in parts)
    orders = [
        EpochSampler(N, BATCH, shuffle=True, seed=7, block=BLOCK, window=WINDOW, nodes=4).order(e) for e in (0, 1)
    ]
    assert not np.array_equal(orders[0], orders[1])  # shuffled anew within each part


def test_one_node_is_the_order_of_before() -> None:
    s = EpochSampler(N, BATCH, shuffle=True, seed=7, block=BLOCK, window=WINDOW)
    assert s.nodes == 1
    want = block_order(N, BLOCK, WINDOW, np.random.default_rng([7, 3]))
    assert np.array_equal(s.order(3), want)


def moved(before: int, after: int, n: int = 20_000, block: int = 64) -> float:
    """The fraction of the dataset whose node changes when ``before`` nodes become ``after``."""
    a, b = node_parts(n, block, 0, before), node_parts(n, block, 0, after)
    owner_a, owner_b = np.empty(-(-n // block), int), np.empty(-(-n // block), int)
    for j, blocks in enumerate(a):
        owner_a[blocks] = j
    for j, blocks in enumerate(b):
        owner_b[blocks] = j
    return float(np.mean(owner_a != owner_b))


def test_a_change_of_node_count_moves_few_blocks() -> None:
    assert moved(2, 3) <= 1 / 3 + 0.10, moved(2, 3)  # the new node takes its share, about a third
    assert moved(4, 3) <= 1 / 4 + 0.15, moved(4, 3)  # the node that went: its quarter, spread over the others
    parts = node_parts(20_000, 64, 0, 3)
    assert max(map(len, parts)) - min(map(len, parts)) <= 1  # equal to a block


def torchrun(monkeypatch: pytest.MonkeyPatch, nodes: int, per_node: int, rank: int = 0) -> None:
    """The variables torchrun gives ``rank`` of ``nodes`` nodes of ``per_node`` ranks."""
    monkeypatch.setenv("WORLD_SIZE", str(nodes * per_node))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("LOCAL_RANK", str(rank % per_node))
    monkeypatch.setenv("GROUP_RANK", str(rank // per_node))
    monkeypatch.delenv("NODE_RANK", raising=False)


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 3), (2, 1)])
def test_a_world_resumed_on_another_number_of_nodes_reads_every_row_once(monkeypatch, before, after) -> None:
    opts = {"shuffle": True, "seed": 5, "batch_size": BATCH, "shuffle_window": WINDOW, "processes": 0, "concurrency": 4}
    torchrun(monkeypatch, before, 2)
    saver_world = before * 2
    got: Counter[int] = Counter()
    state = None
    for rank in range(saver_world):
        torchrun(monkeypatch, before, 2, rank)
        loader = AsyncLoader(Rows(N, block=BLOCK), rank=rank, world_size=saver_world, **opts)
        assert loader.sampler.nodes == before
        it = iter(loader)
        for _ in range(3):  # each rank trains 3 batches, then the job stops
            got.update(int(i) for i in next(it)["x"])
        if rank == 0:
            state = loader.state_dict()
        it.close()
        loader.close()
    torchrun(monkeypatch, after, 2)
    for rank in range(after * 2):
        torchrun(monkeypatch, after, 2, rank)
        loader = AsyncLoader(Rows(N, block=BLOCK), rank=rank, world_size=after * 2, **opts)
        assert loader.sampler.nodes == after
        loader.load_state_dict(state)
        got.update(int(i) for b in loader for i in b["x"])
        loader.set_epoch(1)
        assert loader.sampler.nodes == after  # the next epoch: this world's own parts
        loader.close()
    assert set(got) == set(range(N))
    assert sum(got.values()) - N < 2 * (saver_world + after * 2)  # pads only


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"GROUP_RANK": "1"}, "LOCAL_WORLD_SIZE is not"),
        ({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "a multiple of LOCAL_WORLD_SIZE"),
        (
            {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "LOCAL_RANK": "0", "RANK": "3"},
            "nodes run different numbers of ranks",
        ),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "two"}, "must be integers"),
    ],
)
def test_a_contradictory_torchrun_environment_is_refused(monkeypatch, env, message) -> None:
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ConfigError, match=message):
        node_count(4)


def test_nodes_from_torchrun(monkeypatch) -> None:
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert node_count(8) == 1  # no torchrun: one node
    torchrun(monkeypatch, 4, 2, rank=7)
    assert node_count(8) == 4
    monkeypatch.delenv("GROUP_RANK")  # a launcher that numbers no nodes: their sizes cannot be checked
    assert node_count(8) == 1
    monkeypatch.setenv("NODE_RANK", "3")
    assert node_count(8) == 4
    assert node_count(2) == 1  # a loader of another world (explicit rank=/world_size=): one node
    loader = AsyncLoader(Rows(N, block=BLOCK), rank=0, world_size=8, shuffle=True, shuffle_scope="global", processes=0)
    assert loader.sampler.nodes == 1
    loader.close()


def _variables(sizes: list[int], numbered: bool) -> list[tuple[str | None, ...]]:
    """Each rank's ``NODE_VARIABLES`` in a world of nodes of ``sizes`` ranks, as a launcher numbers them."""
    world, out, rank = sum(sizes), [], 0
    for node, size in enumerate(sizes):
        for local in range(size):
            group = str(node) if numbered else None
            out.append((str(world), str(size), group, None, str(rank), str(local)))
            rank += 1
    return out


@pytest.mark.parametrize("sizes", [[4, 2, 2], [2, 2, 4], [2, 1, 1], [3, 3, 2]])
def test_nodes_of_different_sizes_get_one_verdict_on_every_rank(sizes) -> None:
    """Every rank computes the verdict from all ranks' variables: one message naming each node's size where
    the nodes are numbered; without numbers every rank reads the world as one node (exact, no refusal)."""
    numbered = _variables(sizes, numbered=True)
    wrong = world_verdict(sum(sizes), numbered)
    assert wrong is not None and wrong.startswith(f"the {sum(sizes)} ranks do not describe one world of equal nodes")
    for node, size in enumerate(sizes):
        assert f"node {node} (LOCAL_WORLD_SIZE={size})" in wrong
    assert "launch nodes of one size, or set shuffle_scope='global'" in wrong
    unnumbered = _variables(sizes, numbered=False)
    if any(sum(sizes) % size for size in sizes):  # "a multiple of LOCAL_WORLD_SIZE": refused all the same
        assert "ranks do not describe one world of equal nodes" in (world_verdict(sum(sizes), unnumbered) or "")
        return
    assert world_verdict(sum(sizes), unnumbered) is None
    assert {
        node_count(sum(sizes), {k: v for k, v in zip(NODE_VARIABLES, r, strict=True) if v}) for r in unnumbered
    } == {1}


def test_equal_nodes_pass_the_verdict() -> None:
    assert world_verdict(8, _variables([2, 2, 2, 2], numbered=True)) is None
    assert node_count(8, {k: v for k, v in zip(NODE_VARIABLES, _variables([2] * 4, True)[5], strict=True) if v}) == 4


def _world_rank_main(rank: int, port: int, sizes: list[int], numbered: bool, out: str) -> None:
    """One gloo rank of a world of nodes of ``sizes`` ranks, its variables as a launcher sets them: its rows
    of one node-stable epoch, or the error its loader raised, into ``out``."""
    import json
    import os

    import torch.distributed as dist

    os.environ.update({k: v for k, v in zip(NODE_VARIABLES, _variables(sizes, numbered)[rank], strict=True) if v})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=sum(sizes))
    try:
        try:
            loader = AsyncLoader(Rows(N, block=BLOCK), batch_size=BATCH, shuffle=True, seed=3, processes=0)
            got: dict = {"rows": [int(i) for b in loader for i in b["x"]], "nodes": loader.sampler.nodes}
            loader.close()
        except ConfigError as exc:
            got = {"error": str(exc)}
        with open(os.path.join(out, f"r{rank}.json"), "w") as f:
            json.dump(got, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.xdist_group("process_storms")
def test_gloo_ranks_of_unequal_nodes_all_refuse_with_one_message_or_read_exactly(tmp_path) -> None:
    import json
    import socket

    import torch.multiprocessing as mp

    sizes = [2, 1, 1]
    for numbered in (True, False):
        out = tmp_path / str(numbered)
        out.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.start_processes(
            _world_rank_main, args=(port, sizes, numbered, str(out)), nprocs=4, start_method="forkserver"
        )
        got = [json.loads((out / f"r{r}.json").read_text()) for r in range(4)]
        if numbered:  # every rank: the same refusal, naming each node's size
            assert {g.get("error") for g in got} == {world_verdict(4, _variables(sizes, True))}
            assert (
                "node 0 (LOCAL_WORLD_SIZE=2): ranks [0, 1]; node 1 (LOCAL_WORLD_SIZE=1): ranks [2]" in got[0]["error"]
            )
        else:  # no node numbers: one node for every rank, and the epoch exact
            assert [g["nodes"] for g in got] == [1, 1, 1, 1]
            rows = Counter(i for g in got for i in g["rows"])
            assert set(rows) == set(range(N)) and sum(rows.values()) - N < 4
