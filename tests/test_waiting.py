"""Issue 51: is training waiting on data, and on which stage? ``stats()["waiting_on"]`` made true by the
real thing each time: a consumer that sleeps per batch, a store whose reads sleep, a transform and an
augmentation that burn CPU; summed over real DataLoader workers (``AsyncIterableDataset.stats()``); seen
through a ``DeviceFeed``; logged to a writer (``StatsLogger``) and through Lightning's logger."""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, ConfigError, DeepLakeSource, DeviceFeed, Resize, StatsLogger
from asyncload.engine.stats import summary, verdict

from .conftest import ROWS, WORKER_START
from .sources import DelayedSource

pytestmark = pytest.mark.timeout(60)

BATCH = 16
BATCHES = -(-ROWS // BATCH)  # 13
#: The stage keys every ``stats()`` has (seconds, summed over batches).
STAGE_KEYS = ("open_s", "read_s", "decode_s", "augment_s", "transform_s", "collate_s", "queue_s", "step_s")


def tenth_of_a_second(indices: list[int]) -> float:
    """Each request's delay (module level: the source is pickled into DataLoader workers)."""
    return 0.1


def burn(sample: dict[str, Any]) -> dict[str, Any]:
    """A transform that costs 3 ms of CPU per sample (holding the GIL, as Python transforms do)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.003:
        pass
    return sample


def consume(batches: Any, sleep_s: float = 0.0) -> int:
    n = 0
    for _ in batches:
        n += 1
        time.sleep(sleep_s)
    return n


def test_a_slow_training_step_is_what_a_fast_loader_waits_on(seg_url: str) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), BATCH, processes=0)
    assert consume(loader, sleep_s=0.05) == BATCHES
    s = loader.stats()
    assert s["waiting_on"] == "training", s["waiting_on_why"]
    assert s["waiting_on_why"].startswith("the training step is the slower side: the loop waited for data")
    assert s["consumer_wait_frac"] < 0.10
    assert s["step_s"] >= (BATCHES - 1) * 0.05  # the sleeps between next() calls (the last one's too)
    assert s["queue_s"] > s["steady_wait_s"]  # batches waited for the consumer, not the other way round
    assert all(isinstance(s[k], float) and s[k] >= 0.0 for k in STAGE_KEYS)
    assert s["rank"] == 0 and s["cpu_workers"] >= 2 and summary(s).startswith("waiting on training (data wait ")


def test_a_slow_store_is_what_training_waits_on(seg_url: str) -> None:
    loader = AsyncLoader(DelayedSource(seg_url, tenth_of_a_second), BATCH, processes=0, concurrency=BATCH)
    assert consume(loader) == BATCHES
    s = loader.stats()
    assert s["waiting_on"] == "store", s["waiting_on_why"]
    assert s["consumer_wait_frac"] > 0.8
    assert s["read_s"] >= BATCHES * 0.1  # one request per batch, each 0.1 s
    assert s["wait_on_store_s"] > 0.8 * s["steady_wait_s"]
    assert "of that wait was on the store's reads" in s["waiting_on_why"]
    assert summary(s) == f"waiting on store (data wait {s['consumer_wait_frac']:.0%})"


def test_a_costly_transform_is_what_training_waits_on(seg_url: str) -> None:
    loader = AsyncLoader(DeepLakeSource(seg_url), BATCH, processes=0, transform=burn, cpu_workers=2)
    consume(loader)
    s = loader.stats()
    assert s["waiting_on"] == "transform", s["waiting_on_why"]
    assert s["transform_s"] >= ROWS * 0.003
    assert s["wait_on_transform_s"] > max(s[f"wait_on_{k}_s"] for k in ("store", "decode", "augment", "collate"))
    assert s["cpu_busy_frac"] > 0.5


def test_a_costly_augmentation_is_what_training_waits_on(seg_url: str) -> None:
    """Upscaling 40x56 images to 1024x1024 costs more than decoding them: the augmentation is timed apart."""
    loader = AsyncLoader(DeepLakeSource(seg_url), BATCH, processes=0, augment=[Resize((1024, 1024))], cpu_workers=1)
    consume(loader)
    s = loader.stats()
    assert s["waiting_on"] == "augment", s["waiting_on_why"]
    assert s["augment_s"] > s["decode_s"] and s["transform_s"] == 0.0
    assert "the augmentation (augment=)" in s["waiting_on_why"]


def test_dataloader_workers_report_stats_summed_over_them(seg_url: str) -> None:
    """Two DataLoader workers, each its own loader in its own process: the dataset's stats() in this
    process sums their figures (shared memory), and decides the verdict from the sums."""
    slow = DelayedSource(seg_url, tenth_of_a_second)
    ds = AsyncIterableDataset(slow, BATCH, processes=0, concurrency=BATCH, cpu_workers=2)
    dl = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)
    assert ds.stats()["waiting_on"] == "start"  # no worker has written yet
    assert consume(dl) == BATCHES
    s = ds.stats()
    # (each worker's first batch in two requests: its first sample alone, then the rest)
    assert (s["batches_yielded"], s["samples_yielded"], s["requests"]) == (BATCHES, ROWS, BATCHES + 2)
    assert s["read_s"] >= BATCHES * 0.1  # both workers' reads
    assert s["cpu_workers"] == 2 * 2
    assert s["waiting_on"] == "store", s["waiting_on_why"]
    # the training loop's own figures, when measured in this process (the Lightning callback does), decide
    assert ds.stats(wait_s=0.01, step_s=2.0)["waiting_on"] == "training"


def test_a_device_feed_reports_the_copy_and_the_training_loops_wait(seg_url: str) -> None:
    loader = AsyncLoader(DelayedSource(seg_url, tenth_of_a_second), BATCH, processes=0, concurrency=BATCH)
    feed = DeviceFeed(loader, "cpu", depth=1)
    assert consume(feed) == BATCHES
    s = feed.stats()
    assert s["batches_yielded"] == BATCHES and s["copy_s"] >= 0.0 and s["copy_wait_frac"] > 0.5
    assert s["waiting_on"] == "store", s["waiting_on_why"]
    fast = DeviceFeed(AsyncLoader(DeepLakeSource(seg_url), BATCH, processes=0), "cpu", depth=1)
    consume(fast, sleep_s=0.05)
    assert fast.stats()["waiting_on"] == "training"


class Recording:
    """A writer as StatsLogger sees one: anything with ``add_scalar`` (TensorBoard's SummaryWriter)."""

    def __init__(self) -> None:
        self.points: list[tuple[str, float, int]] = []

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.points.append((tag, value, step))


def test_stats_logger_writes_the_figures_every_n_batches(seg_url: str) -> None:
    writer = Recording()
    log = StatsLogger(writer, every_n_batches=5)
    loader = AsyncLoader(DelayedSource(seg_url, tenth_of_a_second), BATCH, processes=0, concurrency=BATCH)
    assert consume(log.watch(loader)) == BATCHES
    steps = sorted({step for _, _, step in writer.points})
    assert steps == [5, 10, BATCHES]  # every 5 batches, and at the end
    last = {tag: value for tag, value, step in writer.points if step == BATCHES}
    assert last["asyncload/waiting_on/store"] == 1.0 and last["asyncload/waiting_on/training"] == 0.0
    assert last["asyncload/read_s"] == pytest.approx(loader.stats()["read_s"])
    assert {"asyncload/consumer_wait_frac", "asyncload/decode_s", "asyncload/wait_on_store_s"} <= set(last)
    assert all(isinstance(v, float) for v in last.values())
    with pytest.raises(ConfigError, match=r"^writer=object\(\) is not allowed|^writer=<object object"):
        StatsLogger(object())
    with pytest.raises(ConfigError, match=r"^every_n_batches=0 is not allowed: an int >= 1"):
        StatsLogger(writer, every_n_batches=0)


def test_the_verdict_rule() -> None:
    """``verdict`` on figures as ``stats()`` has them: the rule of its docstring, step by step."""
    base = {"batches_yielded": 10, "wait_on_other_s": 0.0, "cpu_busy_frac": 0.2}
    assert verdict({"batches_yielded": 0})[0] == "start"
    assert verdict(base | {"consumer_wait_frac": 0.09})[0] == "training"
    waits = {"wait_on_store_s": 1.0, "wait_on_decode_s": 3.0, "wait_on_collate_s": 0.5}
    assert verdict(base | {"consumer_wait_frac": 0.5} | waits) == (
        "decode", "the training loop waited for data 50% of its time; 67% of that wait was on decoding"
    )  # fmt: skip
    assert verdict(base | {"consumer_wait_frac": 0.5, "copy_wait_frac": 0.05} | waits)[0] == "copy"
    # nothing to attribute: the CPU pool's load decides
    busy = base | {"consumer_wait_frac": 0.5, "cpu_busy_frac": 0.9, "collate_s": 2.0, "decode_s": 1.0}
    assert verdict(busy)[0] == "collate"
    assert verdict(base | {"consumer_wait_frac": 0.5})[0] == "store"
