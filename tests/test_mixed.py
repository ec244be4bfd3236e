"""``MixedSource`` (``sources/mixed``) and the order of a mixed epoch (``engine/mixing``): exact counts,
cycling, per-batch proportions, what each batch carries, resume, DataLoader workers."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, ConfigError, DeepLakeSource, MixedSource, Shard, make_dataset
from asyncload.engine.mixing import MixedOrder
from asyncload.sources.mixed import largest_remainder

from .conftest import HEIGHT, ROWS, WIDTH, WORKER_START
from .resume import check_resume

pytestmark = pytest.mark.timeout(120)

SMALL = 61  # the second source's rows


@pytest.fixture(scope="module")
def small_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A second dataset, of other rows (another seed) and JPEG images: a "synthetic" one beside ``seg_url``."""
    path = tmp_path_factory.mktemp("mixed") / "small"
    return make_dataset(str(path), SMALL, height=HEIGHT, width=WIDTH, seed=5, image_format="jpg", progress=False)


def mix(seg_url: str, small_url: str, weights=None, epoch_rows=None) -> MixedSource:
    return MixedSource({"real": DeepLakeSource(seg_url), "synth": DeepLakeSource(small_url)}, weights, epoch_rows)


def rows_of(order: MixedOrder, positions: np.ndarray) -> list[tuple[int, int]]:
    which, rows = order.mix.locate(positions.tolist())
    return list(zip(which.tolist(), rows.tolist(), strict=True))


def test_counts_are_exact_by_largest_remainder() -> None:
    assert largest_remainder(10, [1, 1, 1]) == [4, 3, 3]
    assert largest_remainder(100, [0.7, 0.2, 0.1]) == [70, 20, 10]
    assert largest_remainder(7, [2, 5]) == [2, 5]
    assert sum(largest_remainder(1001, [0.33, 0.33, 0.34])) == 1001


def test_a_source_asked_for_fewer_rows_cycles_and_one_asked_for_more_repeats_evenly(seg_url, small_url) -> None:
    """100 rows an epoch of the 203-row source: epochs 0-2 cover all 203, each epoch a different part,
    no row twice in an epoch; the 61-row source asked for 150 gives each row 2 or 3 times."""
    src = mix(seg_url, small_url, {"real": 2, "synth": 3}, epoch_rows=250).open()
    order = MixedOrder(src.composition())
    assert src.composition().counts == (100, 150) and len(src) == 250
    seen: Counter[int] = Counter()
    for epoch in range(6):
        got = rows_of(order, order.order(7, epoch, True, 64, 4096))
        per = Counter(w for w, _ in got)
        assert per == {0: 100, 1: 150}, epoch  # exact counts, every epoch
        real = [r for w, r in got if w == 0]
        assert len(set(real)) == 100, epoch  # no row twice in an epoch
        seen.update(real)
        if epoch % 3 == 2:  # each cycle of three epochs covers the source, a row twice at most
            assert set(seen) == set(range(ROWS)) and max(seen.values()) == 2
            seen.clear()
        synth = Counter(r for w, r in got if w == 1)
        assert set(synth) == set(range(SMALL)) and set(synth.values()) <= {2, 3}, epoch
    # A pure function of (seed, epoch): the same order again, another for another seed.
    assert (order.order(7, 4, True, 64, 4096) == order.order(7, 4, True, 64, 4096)).all()
    assert (order.order(7, 4, True, 64, 4096) != order.order(8, 4, True, 64, 4096)).any()


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_batch_of_every_rank_keeps_the_proportion(seg_url, small_url, shuffle) -> None:
    src = mix(seg_url, small_url, {"real": 0.7, "synth": 0.3}, epoch_rows=300).open()
    loader = AsyncLoader(src, batch_size=20, shuffle=shuffle, seed=3, processes=0)
    for world in (1, 3):
        for rank in range(world):
            sampler = loader.options.sampler(len(src), loader.shard.__class__(rank, world), src.block_rows,
                                             mix=MixedOrder(src.composition()))  # fmt: skip
            for epoch in range(3):
                for batch in sampler.batches(epoch):
                    if len(batch) < 20:
                        continue
                    which, _ = src.composition().locate(batch)
                    assert abs(int((which == 1).sum()) - 20 * 0.3) <= 2, (world, rank, epoch, which)
    loader.close()


def test_a_mixed_epoch_read_carries_source_and_index(seg_url, small_url, seg_arrays) -> None:
    """Read through the default reader process: each batch's ``"source"`` and ``"index"`` name its rows, the
    pixels are those rows', the JPEG source's and the PNG source's images decoded alike."""
    import deeplake

    small = deeplake.open_read_only(small_url)
    src = mix(seg_url, small_url, {"real": 3, "synth": 1}, epoch_rows=160)
    with AsyncLoader(src, batch_size=16, shuffle=True, seed=1) as loader:
        assert loader.processes == 1  # Deep Lake's reads in a reader process, as for one source
        batches = list(loader)
        block = loader.options.sampler(len(src), Shard(), src.block_rows).block  # (a small set: a full shuffle)
        order = MixedOrder(src.composition()).order(1, 0, True, block, 4096)
    expected = rows_of(MixedOrder(src.composition()), order)
    got = [(int(w), int(i)) for b in batches for w, i in zip(b["source"], b["index"], strict=True)]
    assert got == expected
    print("per-batch rows of 'synth' (weight 1 of 4, batch 16):", [int((b["source"] == 1).sum()) for b in batches])
    assert all(int((b["source"] == 1).sum()) == 4 for b in batches)
    assert batches[0]["source"].dtype == batches[0]["index"].dtype and str(batches[0]["source"].dtype) == "torch.int64"
    b = batches[0]
    for k in range(16):
        i = int(b["index"][k])
        if int(b["source"][k]) == 0:
            assert (b["images"][k].numpy() == seg_arrays["images"][i]).all()
            assert (b["masks"][k].numpy() == seg_arrays["masks"][i]).all()
        else:
            assert (b["masks"][k].numpy() == np.array(small[i]["masks"])).all()


def test_columns_must_match_or_be_renamed(seg_url, small_url) -> None:
    with pytest.raises(ConfigError, match=r"source 'synth' .* gives columns \['images'\], source 'real' gives "
                                          r"\['images', 'masks'\] \(missing \['masks'\]"):  # fmt: skip
        MixedSource({"real": DeepLakeSource(seg_url), "synth": DeepLakeSource(small_url, columns=("images",))})
    with pytest.raises(ConfigError, match=r"weights name \['real'\], the sources \['real', 'synth'\]"):
        mix(seg_url, small_url, {"real": 1})
    with pytest.raises(ConfigError, match=r"weights\['synth'\]=0 is not allowed"):
        mix(seg_url, small_url, {"real": 1, "synth": 0})
    renamed = MixedSource(
        {"real": DeepLakeSource(seg_url, columns=("images",)), "synth": DeepLakeSource(small_url, columns=("masks",))},
        columns={"synth": {"masks": "images"}},
    )
    assert renamed.columns == ("images", "source")
    with pytest.raises(ConfigError, match="column 'images' is 'image' in source 'real' and 'mask' in source 'synth'"):
        renamed.open()


def test_mixed_resume_through_the_shared_helper(seg_url, small_url) -> None:
    src = mix(seg_url, small_url, {"real": 1, "synth": 1}, epoch_rows=96)
    check_resume(lambda: AsyncLoader(src, batch_size=16, shuffle=True, seed=2, processes=0), in_order=True, epochs=1)


def test_a_changed_mixture_is_refused_on_resume(seg_url, small_url) -> None:
    loader = AsyncLoader(mix(seg_url, small_url, {"real": 1, "synth": 1}, 96), batch_size=16, processes=0)
    state = loader.state_dict()
    other = AsyncLoader(mix(seg_url, small_url, {"real": 2, "synth": 1}, 96), batch_size=16, processes=0)
    with pytest.raises(ConfigError, match=r"saved on version 'mix\(real=\S+:48, synth=\S+:48\)'.*'mix\(real=\S+:64"):
        other.load_state_dict(state)


class Unversioned(DeepLakeSource):
    """A source that cannot say its version or identity (as a custom source whose store has none)."""

    def _version(self, handle) -> None:  # noqa: ANN001
        return None

    def _identity(self, handle) -> None:  # noqa: ANN001
        return None


def test_a_mixture_with_a_source_of_unknown_version_has_none_and_names_the_identities(seg_url, small_url) -> None:
    real, synth = DeepLakeSource(seg_url), DeepLakeSource(small_url)
    both = MixedSource({"real": real, "synth": synth})
    assert both.version == f"mix(real={real.version}:{ROWS}, synth={synth.version}:{len(synth)})"
    assert both.identity == f"mix(real={real.identity}, synth={synth.identity})"
    unknown = MixedSource({"real": DeepLakeSource(seg_url), "synth": Unversioned(small_url)})
    assert unknown.version is None and unknown.store_key is None  # not a string that reads as a version
    assert unknown.identity == f"mix(real={real.identity}, synth=?)"
    assert MixedSource({"a": Unversioned(seg_url), "b": Unversioned(small_url)}).identity is None
    state = AsyncLoader(unknown, batch_size=16, processes=0).state_dict()
    assert state["plan"]["dataset_version"] is None and state["plan"]["dataset_url"] == unknown.url
    with pytest.raises(ConfigError, match=r"another dataset than mix\(real=\S+, synth=\S+\) \(identity 'mix\("):
        AsyncLoader(both, batch_size=16, processes=0).load_state_dict(state)


@pytest.mark.timeout(180)
def test_dataloader_workers_read_a_mixture_exactly_and_resume(seg_url, small_url) -> None:
    src = mix(seg_url, small_url, {"real": 3, "synth": 1}, epoch_rows=160)

    def rows(batches) -> list[list[tuple[int, int]]]:
        return [list(zip(b["source"].tolist(), b["index"].tolist(), strict=True)) for b in batches]

    ref = rows(AsyncLoader(src, batch_size=16, shuffle=True, seed=4, processes=0).__iter__())
    ds = AsyncIterableDataset(src, batch_size=16, shuffle=True, seed=4)
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)
    taken = []
    for b in dl:
        taken.append(b)
        if len(taken) == 3:
            break
    state = ds.state_dict(batches_consumed=3)
    resumed = AsyncIterableDataset(src, batch_size=16, shuffle=True, seed=4)
    resumed.load_state_dict(state)
    rest = list(DataLoader(resumed, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START))
    assert rows(taken) + rows(rest) == ref
