"""DeviceFeed: the CPU path everywhere, the CUDA path (pin thread, pinned ring, side stream) where a GPU exists."""

from __future__ import annotations

import gc
import time
from collections import OrderedDict, namedtuple
from collections.abc import Iterator

import pytest
import torch

from asyncload import AsyncLoader, ConfigError, DeepLakeSource
from asyncload.device import DeviceFeed

from .conftest import ROWS, wait_no_loop_threads

Pair = namedtuple("Pair", ["left", "right"])

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def nested_batch(k: int) -> dict:
    g = torch.Generator().manual_seed(k)
    return {
        "images": torch.randint(0, 256, (4, 8, 6, 3), dtype=torch.uint8, generator=g),
        "meta": OrderedDict(index=torch.arange(4) + 4 * k, name=f"batch{k}", weight=0.5),
        "pair": (torch.randn(4, 2, generator=g), [torch.randn(3, generator=g), 7]),
        "named": Pair(torch.full((2,), k), None),
    }


@pytest.fixture
def pinned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The shapes of the pinned host tensors made while the test runs (``torch.empty(..., pin_memory=True)``,
    on any thread): what the feed allocates for staging, seen from outside it."""
    made: list[tuple[int, ...]] = []
    empty = torch.empty

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - torch.empty's own signature
        t = empty(*args, **kwargs)
        if kwargs.get("pin_memory"):
            made.append(tuple(t.shape))
        return t

    monkeypatch.setattr(torch, "empty", counting)
    return made


def assert_same(a, b) -> None:
    """Same nesting, same container types, equal tensors; non-tensor leaves unchanged."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.timeout(20)
@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_cpu_yields_the_same_nested_batches_unchanged(depth: int, pinned: list[tuple[int, ...]]) -> None:
    batches = [nested_batch(k) for k in range(4)]
    feed = DeviceFeed(batches, "cpu", depth=depth)
    got = list(feed)
    assert len(got) == feed.batches == 4
    for src, out in zip(batches, got, strict=True):
        assert_same(src, out)
        assert out["images"] is src["images"]  # already contiguous on the device: handed over as is
        assert out["meta"]["name"] == src["meta"]["name"] and out["named"].right is None
    assert feed.pin_memory is False and pinned == []


@pytest.mark.timeout(20)
def test_cpu_makes_non_contiguous_tensors_contiguous_with_the_same_values() -> None:
    t = torch.arange(24).reshape(4, 6).t()
    assert not t.is_contiguous()
    (out,) = list(DeviceFeed([[t]], torch.device("cpu")))
    assert out[0].is_contiguous() and torch.equal(out[0], t)


@pytest.mark.timeout(20)
def test_pin_memory_is_skipped_off_cuda() -> None:
    feed = DeviceFeed([{"x": torch.ones(3)}], "cpu", pin_memory=True)
    assert feed.pin_memory is False  # pinned staging only serves copies to CUDA
    (out,) = list(feed)
    assert not out["x"].is_pinned() and torch.equal(out["x"], torch.ones(3))


@pytest.mark.timeout(20)
def test_wait_s_counts_the_time_the_consumer_waited_for_data() -> None:
    def slow() -> Iterator[dict]:
        for k in range(4):
            time.sleep(0.05)
            yield {"x": torch.tensor([k])}

    feed = DeviceFeed(slow(), "cpu", depth=1)
    t0 = time.perf_counter()
    for _ in feed:
        time.sleep(0.02)  # the "step": not waiting for data
    total = time.perf_counter() - t0
    assert 0.2 <= feed.wait_s < total - 0.07
    assert feed.batches == 4


@pytest.mark.timeout(20)
@pytest.mark.parametrize("depth", [0, 2])
def test_depth_stages_that_many_batches_ahead(depth: int) -> None:
    pulled = []

    def source() -> Iterator[int]:
        for k in range(6):
            pulled.append(k)
            yield k

    feed = DeviceFeed(source(), "cpu", depth=depth)
    for k, item in enumerate(feed):
        assert item == k
        assert len(pulled) == min(k + 1 + depth, 6)


@pytest.mark.timeout(20)
def test_close_and_del_close_the_upstream_iterator() -> None:
    closed = []

    def source() -> Iterator[int]:
        try:
            yield from range(100)
        finally:
            closed.append(True)

    feed = DeviceFeed(source(), "cpu")
    assert next(feed) == 0
    feed.close()
    assert closed == [True]
    assert list(feed) == []

    feed = DeviceFeed(source(), "cpu")
    next(feed)
    del feed
    gc.collect()
    assert closed == [True, True]

    with DeviceFeed(source(), "cpu") as feed:
        next(feed)
    assert closed == [True, True, True]


@pytest.mark.timeout(20)
def test_bad_settings_name_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"^depth=-1 is not allowed: an int >= 0$"):
        DeviceFeed([], "cpu", depth=-1)
    with pytest.raises(ConfigError, match=r"^device='gpu' is not allowed: a torch device"):
        DeviceFeed([], "gpu")


@pytest.mark.timeout(20)
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_cuda_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^device='cuda' is not allowed: CUDA is not available here; use 'cpu'$"):
        DeviceFeed([], "cuda")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_feeds_an_asyncload_epoch_and_stops_its_thread_on_close(seg_url: str, seg_arrays, device: str) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), batch_size=16, shuffle=True, seed=1, concurrency=32)
    seen = []
    with DeviceFeed(loader, device) as feed:
        for b in feed:
            assert b["images"].device.type == device
            idx = b["index"].cpu()
            seen.extend(idx.tolist())
            assert torch.equal(b["images"].cpu(), torch.from_numpy(seg_arrays["images"][idx.numpy()]))
    assert sorted(seen) == list(range(ROWS))
    assert feed.wait_s > 0

    feed = DeviceFeed(loader, device)
    next(feed)
    feed.close()  # closes the epoch iterator: its loop thread stops now, not at garbage collection
    assert feed.thread is None or not feed.thread.is_alive()  # the pin thread (CUDA) too
    wait_no_loop_threads()


# -- CUDA --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(60)
@pytest.mark.parametrize("pin", [None, False])
def test_cuda_values_devices_and_pinned_ring_reuse(pin: bool | None, pinned: list[tuple[int, ...]]) -> None:
    batches = [nested_batch(k) for k in range(20)]
    feed = DeviceFeed(batches, "cuda", depth=2, pin_memory=pin)
    got = list(feed)
    for src, out in zip(batches, got, strict=True):
        assert_same(src, out)
        assert out["images"].device.type == "cuda" and out["meta"]["name"] == src["meta"]["name"]
    tensors_per_batch = 5
    if pin is None:
        assert feed.pin_memory
        # shapes repeat: the ring stops growing at depth + 3 buffers per tensor position
        assert 0 < len(pinned) <= (2 + 3) * tensors_per_batch
    else:
        assert pinned == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(60)
def test_cuda_consumer_on_its_own_stream_never_reads_a_half_copied_batch() -> None:
    # Large batches make each copy take long enough that a missing stream wait would show as wrong sums.
    batches = [{"x": torch.full((16, 1024, 1024), k, dtype=torch.int32)} for k in range(8)]  # 64 MiB each
    consumer = torch.cuda.Stream()
    sums = []
    with torch.cuda.stream(consumer):
        for b in DeviceFeed(batches, "cuda", depth=2):
            sums.append(b["x"].sum())  # queued on the consumer stream, right after the hand-off
        torch.cuda.synchronize()
    assert [int(s) for s in sums] == [k * 16 * 1024 * 1024 for k in range(8)]  # int sums: exact


def counted(n: int, log: list[str], fail_after: int | None = None) -> Iterator[dict]:
    """``n`` small batches; records each pull and the generator's close; raises after ``fail_after``."""
    try:
        for k in range(n):
            if fail_after is not None and k == fail_after:
                raise KeyError(f"batch {k} is missing")
            log.append(f"pull {k}")
            yield {"x": torch.full((4, 256), k, dtype=torch.int32)}
    finally:
        log.append("closed")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(60)
def test_cuda_pin_thread_ends_with_the_epoch_on_close_and_on_gc() -> None:
    log: list[str] = []
    feed = DeviceFeed(counted(5, log), "cuda")
    assert [int(b["x"][0, 0]) for b in feed] == list(range(5))
    assert feed.thread is not None and feed.thread.name == "asyncload-pin" and not feed.thread.is_alive()

    log.clear()
    feed = DeviceFeed(counted(1000, log), "cuda", depth=2)
    next(feed)
    feed.close()  # the pin thread is parked on the full hand-off: woken, it ends and closes the source
    assert feed.thread is not None and not feed.thread.is_alive()
    assert log[-1] == "closed" and len(log) <= 1 + 1 + 2 + 1  # taken + pulled ahead (bounded) + closed
    assert list(feed) == []

    log.clear()
    feed = DeviceFeed(counted(1000, log), "cuda")
    next(feed)
    thread = feed.thread
    del feed  # the pin thread holds no reference to the feed: dropping it stops the thread
    gc.collect()
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive() and log[-1] == "closed"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(60)
def test_cuda_upstream_error_reaches_the_consumer_with_its_type_after_the_batches_before_it() -> None:
    log: list[str] = []
    feed = DeviceFeed(counted(10, log, fail_after=3), "cuda")
    got = [int(next(feed)["x"][0, 0]) for _ in range(3)]
    with pytest.raises(KeyError, match="batch 3 is missing"):
        next(feed)
    assert got == [0, 1, 2] and feed.thread is not None and not feed.thread.is_alive()
    assert list(feed) == []


@pytest.mark.gpu
@needs_cuda
@pytest.mark.timeout(60)
def test_cuda_slow_consumer_does_not_wait_and_the_pin_thread_stays_depth_ahead() -> None:
    log: list[str] = []
    depth = 2
    feed = DeviceFeed(counted(30, log), "cuda", depth=depth)
    first = next(feed)
    assert first["x"].device.type == "cuda"
    waited_first = feed.wait_s
    for k, _ in enumerate(feed, start=2):
        time.sleep(0.01)  # the step: the pin thread has the next batches ready meanwhile
        pulled = sum(1 for e in log if e.startswith("pull"))
        assert pulled <= k + depth + 1  # handed out + waiting in the hand-off + one being staged
    assert feed.batches == 30
    assert feed.wait_s - waited_first < 0.05  # 29 batches taken ready: no waiting for data


@pytest.mark.timeout(60)
@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_feed_state_counts_only_batches_handed_to_the_step(seg_url, in_order, device) -> None:
    """The feed holds batches ahead of the step: its state_dict() leaves them out (the loader's own
    would skip them on resume), so taken + resumed is the whole epoch, each batch once."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    make = lambda: AsyncLoader(DeepLakeSource(seg_url), batch_size=16, shuffle=True, seed=2, in_order=in_order)  # noqa: E731
    ref = sorted(b["index"].tolist() for b in make())
    loader = make()
    feed = DeviceFeed(loader, device, depth=3)
    taken = [next(feed)["index"].tolist() for _ in range(4)]
    time.sleep(0.2)  # the pin thread (CUDA) fills its hand-off meanwhile
    state = feed.state_dict()
    assert loader.state_dict()["next"] + len(loader.state_dict()["extra"]) > 4  # the loader counted read-ahead
    assert state["next"] + len(state["extra"]) == 4
    feed.close()
    again = make()
    again.load_state_dict(state)
    rest = [b["index"].tolist() for b in again]
    assert sorted(taken + rest) == ref and len(taken + rest) == len(ref)
    with pytest.raises(ConfigError, match="needs a loader with state_dict"):
        DeviceFeed(iter([]), "cpu").state_dict()
