"""Node-stable epochs (``engine.nodes``, ``shuffle_scope="node"``): on several nodes each node reads the same
part of the blocks every epoch, shuffled within it, so that the cluster fetches the dataset about once;
every row once per epoch across the world, equal batches per rank, one node's order unchanged, resume on
another number of nodes exact, few blocks moved when the node count changes, torchrun's variables checked."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from asyncload import AsyncLoader, ConfigError
from asyncload.engine.nodes import node_count, node_parts
from asyncload.engine.sampler import EpochSampler, Shard, block_order
from asyncload.sources.base import Columns, Source

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


class Rows(Source[None]):
    """Rows that are their own numbers: what a resume test needs to see, and no store."""

    def __init__(self, n: int) -> None:
        super().__init__("rows://x", ("x",))
        self.n = n

    def _open(self) -> None:
        return None

    def _length(self, handle: None) -> int:
        return self.n

    def _version(self, handle: None) -> str:
        return "v1"

    @property
    def local(self) -> bool:
        return True

    @property
    def block_rows(self) -> int:
        return BLOCK

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        return {"x": np.asarray(indices, dtype=np.int64)}


def torchrun(monkeypatch: pytest.MonkeyPatch, nodes: int, per_node: int) -> None:
    monkeypatch.setenv("WORLD_SIZE", str(nodes * per_node))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK"):
        monkeypatch.delenv(k, raising=False)


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 3), (2, 1)])
def test_a_world_resumed_on_another_number_of_nodes_reads_every_row_once(monkeypatch, before, after) -> None:
    opts = {"shuffle": True, "seed": 5, "batch_size": BATCH, "shuffle_window": WINDOW, "processes": 0, "concurrency": 4}
    torchrun(monkeypatch, before, 2)
    saver_world = before * 2
    got: Counter[int] = Counter()
    state = None
    for rank in range(saver_world):
        loader = AsyncLoader(Rows(N), rank=rank, world_size=saver_world, **opts)
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
        loader = AsyncLoader(Rows(N), rank=rank, world_size=after * 2, **opts)
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
            "numbered together",
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
    torchrun(monkeypatch, 4, 2)
    monkeypatch.setenv("GROUP_RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "7")
    assert node_count(8) == 4
    assert node_count(2) == 1  # a loader of another world (explicit rank=/world_size=): one node
    loader = AsyncLoader(Rows(N), rank=0, world_size=8, shuffle=True, shuffle_scope="global", processes=0)
    assert loader.sampler.nodes == 1
    loader.close()
