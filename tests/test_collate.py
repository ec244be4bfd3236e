"""Columns of any shape from a real Deep Lake dataset: labels and embeddings stack, text is a list of
``str``, boxes and images of varying shapes come as lists or padded with a mask, by column."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, ConfigError, DeepLakeSource
from asyncload.errors import CollateError

pytestmark = pytest.mark.timeout(60)

N = 6
COLUMNS = ("text", "boxes", "label", "emb", "img")


@pytest.fixture(scope="module")
def mixed_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Row ``i``: caption ``"caption i"``, ``i + 1`` boxes filled with ``i``, label ``i``, embedding of
    ``i``, and an ``(8 + i) x 6 x 3`` image filled with ``i``."""
    import deeplake

    url = f"file://{tmp_path_factory.mktemp('mixed')}/ds"
    ds = deeplake.create(url)
    ds.add_column("text", deeplake.types.Text())
    ds.add_column("boxes", deeplake.types.Array(deeplake.types.Float32(), dimensions=2))
    ds.add_column("label", deeplake.types.Int32())
    ds.add_column("emb", deeplake.types.Embedding(4))
    ds.add_column("img", deeplake.types.Image(dtype="uint8", sample_compression="png"))
    for i in range(N):
        ds.append({
            "text": [f"caption {i}"], "boxes": [np.full((i + 1, 4), i, np.float32)], "label": [i],
            "emb": [np.full(4, i, np.float32)], "img": [np.full((8 + i, 6, 3), i, np.uint8)],
        })  # fmt: skip
    ds.commit()
    return url


def first_batch(url: str, **options) -> dict:
    loader = AsyncLoader(DeepLakeSource(url, columns=COLUMNS), batch_size=3, concurrency=4, **options)
    return next(iter(loader))


@pytest.mark.parametrize("mode", ["column", "row"])
@pytest.mark.parametrize("with_transform", [False, True], ids=["columnar", "after-transform"])
def test_each_column_gets_its_expected_form(mixed_url: str, mode: str, with_transform: bool) -> None:
    extra = {"transform": lambda s: s} if with_transform else {}
    b = first_batch(mixed_url, read_mode=mode, ragged={"boxes": "pad", "img": "list"}, **extra)
    assert b["text"] == ["caption 0", "caption 1", "caption 2"]
    assert b["label"].tolist() == [0, 1, 2] and b["label"].dtype == torch.int32
    assert b["emb"].shape == (3, 4) and b["emb"][:, 0].tolist() == [0.0, 1.0, 2.0]
    assert b["boxes"].shape == (3, 3, 4) and b["boxes_mask"].shape == (3, 3, 4)
    for i in range(3):
        assert b["boxes_mask"][i, :, 0].tolist() == [True] * (i + 1) + [False] * (2 - i)
        assert (b["boxes"][i][b["boxes_mask"][i]] == i).all() and (b["boxes"][i][~b["boxes_mask"][i]] == 0).all()
    assert [tuple(t.shape) for t in b["img"]] == [(8, 6, 3), (9, 6, 3), (10, 6, 3)]
    assert all((t == i).all() for i, t in enumerate(b["img"]))
    b["img"][0][0, 0, 0] = 7  # writable copies, not views of the store's buffers
    assert b["index"].tolist() == [0, 1, 2]


def test_one_policy_for_every_column(mixed_url: str) -> None:
    b = first_batch(mixed_url, ragged="pad")
    assert b["img"].shape == (3, 10, 6, 3) and b["img_mask"][0].sum() == 8 * 6 * 3
    assert "label_mask" not in b and "emb_mask" not in b  # equal shapes stack, no mask


def test_unequal_shapes_without_a_policy_say_what_to_pass(mixed_url: str) -> None:
    with pytest.raises(
        CollateError,
        match=r"column 'boxes': sample at index 1 has shape \(2, 4\), but index 0 has \(1, 4\); samples of different shapes need ragged=\{'boxes': 'list' or 'pad'\}",
    ):
        first_batch(mixed_url)


@pytest.mark.parametrize("bad", ["stack", {"boxes": "crop"}, {3: "pad"}])
def test_a_bad_policy_is_refused(mixed_url: str, bad) -> None:
    with pytest.raises(ConfigError, match=r"ragged=.* is not allowed: None, 'list', 'pad' or a dict of column"):
        first_batch(mixed_url, ragged=bad)


@pytest.mark.parametrize(
    "dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
              torch.float64, torch.bool, torch.bfloat16],
)  # fmt: skip
def test_the_default_allocator_gives_every_dtype_a_writable_contiguous_batch_tensor(dtype: torch.dtype) -> None:
    """Batch tensors come through numpy where it has the dtype, each mapped to numpy's own, and through
    torch where numpy has none (bfloat16): either way a writable, contiguous tensor of that dtype and
    shape."""
    from asyncload.runtime.alloc import heap_empty

    t = heap_empty((3, 4, 5), dtype)
    assert t.dtype == dtype and t.shape == (3, 4, 5) and t.is_contiguous() and t.device.type == "cpu"
    t.fill_(1)
    t[1] = 0
    assert t.sum().item() == 40
    assert heap_empty((0, 4), dtype).numel() == 0


def test_a_batch_memory_is_reused_only_once_nothing_views_it() -> None:
    """A batch tensor's memory goes to the next batch of its size once the batch and every view of it are
    gone, and not before: a row kept as a torch view, or a slice of its ``.numpy()``, keeps its pixels."""
    from asyncload.runtime.alloc import _Spares

    spares = _Spares()
    shape = (4, 8, 8, 3)

    def batch(fill: int) -> torch.Tensor:
        t = torch.from_numpy(spares.take(shape, np.dtype(np.uint8)))
        t.fill_(fill)
        return t

    first = batch(1)
    where = first.data_ptr()
    row, cut = first[2], first.numpy()[1:3]
    del first
    for fill in (2, 3):  # while views live, every batch is new memory
        b = batch(fill)
        assert b.data_ptr() != where
        del b
    assert (row == 1).all() and (cut == 1).all()
    del row
    assert batch(4).data_ptr() != where  # the slice still holds it
    del cut
    again = batch(5)  # nothing views the first batch now: its memory comes back
    assert again.data_ptr() == where and (again == 5).all()
    assert (spares.fresh, spares.reused) == (2, 3)


def test_spare_batch_memory_is_bounded_by_size_and_in_all() -> None:
    from asyncload.runtime.alloc import _Spares

    spares = _Spares(per_size=2, limit=2560)
    u8 = np.dtype(np.uint8)
    held = [spares.take((1024,), u8) for _ in range(4)]
    del held  # four of one size let go: two kept
    assert spares._bytes == 2048 and len(spares._free[1024]) == 2
    other = [spares.take((512,), u8) for _ in range(2)]
    del other  # 2,048 + 512 fit the limit; the second 512 does not, and is freed
    assert {n: len(b) for n, b in spares._free.items()} == {1024: 2, 512: 1}
    assert spares._bytes == 2560
    taken = spares.take((2, 256), u8)
    assert taken.shape == (2, 256) and spares.reused == 1  # any shape of that size
    assert 512 not in spares._free and spares._bytes == 2048  # (a size with no spare left is forgotten)
    del taken
    big = spares.take((4096,), u8)  # over the limit: never kept
    del big
    assert 4096 not in spares._free


def test_batches_kept_by_the_consumer_keep_their_pixels(seg_url: str) -> None:
    """An epoch whose batches are all kept to its end has the pixels of one whose batches are dropped as
    they come, and whose memory goes to later batches: the second of two epochs of one loader starts on
    the memory of the first's last batches."""
    from asyncload.runtime import alloc

    def sums(b: dict) -> int:
        return int(b["images"].sum()) + int(b["masks"].sum())

    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=16, shuffle=True, seed=3, processes=0)
    first = [sums(b) for b in loader]
    loader.set_epoch(1)
    reused = alloc._spares.reused
    dropped = [sums(b) for b in loader]
    assert alloc._spares.reused > reused
    assert first != dropped  # two epochs, two orders
    loader.set_epoch(1)
    kept = list(loader)
    assert [sums(b) for b in kept] == dropped
    loader.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_child_forked_while_another_thread_takes_a_spare_allocates_batches() -> None:
    """A process forked while one of its threads held the spares' lock (a decode thread taking memory as a
    DataLoader forks its workers) must not inherit it held: its own batches would wait for ever."""
    from asyncload.runtime import alloc

    with alloc._spares._lock:  # as a decode thread would hold it, at the moment of the fork
        pid = os.fork()
        if pid == 0:  # the child: one batch tensor, or SIGALRM's death within 5 s
            signal.alarm(5)
            t = alloc.heap_empty((4, 8), torch.uint8)
            os._exit(0 if t.shape == (4, 8) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
