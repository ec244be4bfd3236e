"""A resume state is global (``engine/consumed``): saved by one rank, it loads into every rank of any world
size, with any batch size and any number of DataLoader workers, and every row of the epoch comes once
across the old and the new runs (a pad of at most ``world_size - 1`` repeats with ``remainder="pad"``)."""

from __future__ import annotations

import json
import os
import socket
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, ConfigError, DeepLakeSource, MixedSource, Shard, make_dataset
from asyncload.engine.consumed import consumed
from asyncload.engine.progress import EpochProgress
from asyncload.engine.sampler import EpochSampler

from .conftest import HEIGHT, ROWS, WIDTH, WORKER_START, shuffled
from .resume import ids

pytestmark = pytest.mark.timeout(120)

SMALL = 61


@pytest.fixture(scope="module")
def small_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("elastic") / "small"
    return make_dataset(str(path), SMALL, height=HEIGHT, width=WIDTH, seed=5, progress=False)


def _world(n: int, world: int, batch: int, remainder: str = "pad", taken=()) -> list[EpochSampler]:
    return [
        EpochSampler(n, batch, remainder=remainder, shard=Shard(r, world), taken=tuple(taken))  # type: ignore[arg-type]
        for r in range(world)
    ]


@pytest.mark.timeout(30)
def test_any_world_resumes_what_any_world_left() -> None:
    """Samplers only (the order is the identity, so positions are rows): the old world's ranks each take
    ``k`` batches, rank 0's state re-cut for the new world; three generations, pad and drop."""
    for n, chain, k_of in [(203, [(2, 8), (3, 8), (4, 5)], [5, 2, 0]), (50, [(4, 3), (3, 7), (1, 4)], [2, 1, 3]),
                           (7, [(3, 1), (8, 2)], [1, 0])]:  # fmt: skip
        for remainder in ("pad", "drop"):
            taken, seen = (), Counter[int]()
            for (world, batch), k in zip(chain, k_of, strict=False):
                ranks = _world(n, world, batch, remainder, taken)
                for s in ranks:
                    seen.update(i for b in s.batches(0)[:k] for i in b)
                progress = EpochProgress(0, len(ranks[0]), next=min(k, len(ranks[0])))
                taken = consumed(ranks[0], progress)
            world = chain[-1][0]
            for s in _world(n, world, 3, remainder, taken):  # the last world reads the rest
                seen.update(i for b in s.batches(0) for i in b)
            where = f"n={n}, worlds {chain}, {remainder}"
            if remainder == "pad":
                assert set(seen) == set(range(n)), where
                assert sum(seen.values()) - n <= sum(w - 1 for w, _ in chain), where  # each world's pad
            else:
                assert max(seen.values()) == 1 and n - len(seen) <= sum(w - 1 for w, _ in chain), where


def test_a_state_from_rank_0_resumes_rank_1_of_the_same_world(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    ref = shuffled(ROWS, 8, 3)
    ranks = [AsyncLoader(src, batch_size=8, shuffle=True, seed=3, shard=Shard(r, 2), processes=0) for r in (0, 1)]
    it = iter(ranks[0])
    for _ in range(4):
        next(it)
    state = ranks[0].state_dict()
    it.close()
    ranks[1].load_state_dict(state)
    expected = EpochSampler(ROWS, 8, shuffle=True, seed=3, shard=Shard(1, 2), block=ref.block, window=ref.window)
    assert ids(list(ranks[1])) == expected.batches(0)[4:]


def test_a_state_of_the_old_format_still_loads(seg_url) -> None:
    src = DeepLakeSource(seg_url)
    first = AsyncLoader(src, batch_size=16, processes=0)
    it = iter(first)
    taken = ids([next(it) for _ in range(3)])
    it.close()
    state = first.state_dict()
    old = {k: v for k, v in state.items() if k != "cut"}
    old.update(version=2, plan={**state["plan"], **{k: v for k, v in state["cut"].items() if k != "taken"}})
    second = AsyncLoader(src, batch_size=16, processes=0)
    second.load_state_dict(old)
    assert taken + ids(list(second)) == [list(range(i, min(i + 16, ROWS))) for i in range(0, ROWS, 16)]
    with pytest.raises(ConfigError, match="state version 1 is not allowed: 3 \\(or 2\\)"):
        second.load_state_dict({**state, "version": 1})


def test_dataloader_workers_resume_two_ranks_on_one(seg_url, small_url) -> None:
    """A mixture read by 2 ranks (their DataLoaders in this process), rank 0's state loaded into a world of
    one rank with 2 DataLoader workers: every row once."""
    src = MixedSource({"real": DeepLakeSource(seg_url), "synth": DeepLakeSource(small_url)})
    seen: Counter[tuple[int, int]] = Counter()
    state = None
    for rank in (0, 1):
        ds = AsyncIterableDataset(src, batch_size=8, shuffle=True, seed=2, rank=rank, world_size=2, processes=0)
        ds.set_epoch(1)
        for k, b in enumerate(DataLoader(ds, batch_size=None)):
            if k == 6:
                break
            seen.update(zip(b["source"].tolist(), b["index"].tolist(), strict=True))
        if rank == 0:
            state = ds.state_dict(batches_consumed=6)
    one = AsyncIterableDataset(src, batch_size=8, shuffle=True, seed=2, rank=0, world_size=1)
    one.load_state_dict(state)
    one.set_epoch(1)
    dl = DataLoader(one, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)
    rest = list(dl)
    assert len(dl) == len(rest) == -(-(ROWS + SMALL - 2 * 6 * 8) // 8)
    for b in rest:
        seen.update(zip(b["source"].tolist(), b["index"].tolist(), strict=True))
    assert sorted(seen) == [(0, i) for i in range(ROWS)] + [(1, i) for i in range(SMALL)]
    assert set(seen.values()) == {1}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, urls: list[str], out: str, take: int) -> None:
    """One rank: with no saved state, take ``take`` batches of epoch 1 (rank 0 saves the state); with one,
    load it, whoever saved it, and read the rest. Rows are (source, index) of a mixture."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        src = MixedSource({"real": DeepLakeSource(urls[0]), "synth": DeepLakeSource(urls[1])})
        loader = AsyncLoader(src, batch_size=8, shuffle=True, seed=7, processes=0)
        saved = os.path.join(out, "state.json")
        loader.set_epoch(1)
        if os.path.exists(saved):
            with open(saved) as f:
                loader.load_state_dict(json.load(f))
            loader.set_epoch(1)
            length = len(loader)  # the resumed epoch's batches on this rank
            batches = list(loader)
        else:
            length = len(loader)
            it = iter(loader)
            batches = [next(it) for _ in range(take)]
            if rank == 0:
                with open(saved, "w") as f:
                    json.dump(loader.state_dict(), f)
            it.close()
        t = torch.tensor([len(batches)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # every rank has as many batches (collectives in step)
        rows = [list(zip(b["source"].tolist(), b["index"].tolist(), strict=True)) for b in batches]
        with open(os.path.join(out, f"w{world}r{rank}.json"), "w") as f:
            json.dump({"rows": rows, "most": int(t), "len": length}, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(240)
@pytest.mark.xdist_group("process_storms")
def test_spawned_ranks_resume_two_ranks_state_on_three_and_on_four(seg_url, small_url, tmp_path) -> None:
    urls, take = [seg_url, small_url], 5

    def run(world: int, out) -> list[dict]:
        mp.start_processes(_rank_main, args=(world, _free_port(), urls, str(out), take), nprocs=world,
                           start_method="forkserver")  # fmt: skip
        return [json.loads((out / f"w{world}r{r}.json").read_text()) for r in range(world)]

    old = run(2, tmp_path)
    state = (tmp_path / "state.json").read_text()
    print(f"state saved by rank 0 of 2: {len(state)} bytes of JSON")
    taken = Counter(tuple(x) for r in old for b in r["rows"] for x in b)
    assert [len(r["rows"]) for r in old] == [take, take] and sum(taken.values()) == 2 * take * 8
    everything = [(0, i) for i in range(ROWS)] + [(1, i) for i in range(SMALL)]
    for world in (3, 4):
        out = tmp_path / f"to{world}"
        out.mkdir()
        (out / "state.json").write_text(state)
        new = run(world, out)
        lens = [len(r["rows"]) for r in new]
        assert len(set(lens)) == 1 and new[0]["most"] == lens[0] == new[0]["len"]  # equal batches per rank
        got = Counter(tuple(x) for r in new for b in r["rows"] for x in b)
        rows = sum(got.values())
        left = ROWS + SMALL - 2 * take * 8
        print(f"2 ranks took {2 * take * 8} rows; {world} ranks read {rows} ({left} left + {rows - left} pad) "
              f"in {lens[0]} batches each: {[sum(len(b) for b in r['rows']) for r in new]} rows per rank")  # fmt: skip
        both = taken + got
        assert sorted(both) == everything  # every row of the epoch ...
        assert sum(both.values()) - len(everything) == rows - left <= world - 1  # ... once, but the pad


@pytest.mark.timeout(180)
def test_fanout_workers_read_a_mixture_and_resume_another_worlds_state(seg_url, small_url) -> None:
    """``processes=2`` over a mixture gives the batches one process does; then it resumes a state saved by
    rank 0 of 2 (the cut sent to the workers with the epoch), as one process does."""
    src = MixedSource({"real": DeepLakeSource(seg_url), "synth": DeepLakeSource(small_url)}, {"real": 1, "synth": 1})

    def rows(batches) -> list[list[tuple[int, int]]]:
        return [list(zip(b["source"].tolist(), b["index"].tolist(), strict=True)) for b in batches]

    old = AsyncLoader(src, batch_size=8, shuffle=True, seed=4, shard=Shard(0, 2), processes=0)
    it = iter(old)
    for _ in range(3):
        next(it)
    state = old.state_dict()
    it.close()
    one = AsyncLoader(src, batch_size=16, shuffle=True, seed=4, processes=0)
    ref = rows(one)
    one.load_state_dict(state)
    rest = rows(one)
    assert len(rest) == -(-(ROWS + SMALL - 2 * 3 * 8) // 16)
    with AsyncLoader(src, batch_size=16, shuffle=True, seed=4, processes=2) as fan:
        assert rows(fan) == ref
        fan.load_state_dict(state)
        assert rows(fan) == rest
