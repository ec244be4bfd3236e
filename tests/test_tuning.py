"""concurrency="auto": the tuner's decisions (pure) and its behaviour against stores of known shape.

Loaders here read with ``processes=0``: the tests watch the engine in this process (its loop thread, the
source's own counters), which is what a Deep Lake reader process runs too."""

from __future__ import annotations

import pytest

from asyncload import AsyncLoader
from asyncload.engine.shard import TUNER_START
from asyncload.engine.tuning import ConcurrencyTuner, Observation

from .conftest import ROWS
from .sources import CapacitySource

pytestmark = pytest.mark.timeout(120)


def little(limit: int, latency: float = 0.05, capacity: float = 400.0) -> float:
    """Throughput of a store with fixed latency and a capacity ceiling."""
    return min(limit / latency, capacity)


def test_slow_start_finds_the_knee_and_stops_climbing() -> None:
    t = ConcurrencyTuner(start=4, high=512)
    for _ in range(30):
        t.observe(Observation(little(t.samples)))
    assert little(t.samples) >= 0.9 * 400  # within 10% of the best fixed setting
    assert t.samples <= 4 * 20  # ... without taking 512 slots of memory to get there
    assert any(why == "step did not pay: back" for _, _, why in t.history)


def test_it_follows_a_store_that_gets_faster() -> None:
    t = ConcurrencyTuner(start=4, high=512, probe_every=3)
    for _ in range(20):
        t.observe(Observation(little(t.samples, capacity=200)))
    low = t.samples
    for _ in range(40):
        t.observe(Observation(little(t.samples, capacity=1600)))
    assert t.samples > low and little(t.samples, capacity=1600) >= 0.8 * 1600


def test_throttling_halves_and_consumer_bound_holds() -> None:
    t = ConcurrencyTuner(start=64, high=512)
    assert t.observe(Observation(500, throttled=3)) == 32
    assert not t.slow_start
    assert t.observe(Observation(500, consumer_bound=True)) == 32
    assert t.observe(Observation(500, consumer_bound=True)) == 32


def test_limits_are_respected() -> None:
    t = ConcurrencyTuner(start=1000, low=8, high=64)
    assert t.samples == 64
    for _ in range(10):
        t.observe(Observation(1.0, throttled=1))
    assert t.samples == 8


def test_auto_reaches_a_stores_capacity_without_running_away(seg_url) -> None:
    src = CapacitySource(seg_url, slots=12, latency=0.05)  # knee at 12 in flight, 240 samples/s
    loader = AsyncLoader(src, batch_size=8, concurrency="auto", read_mode="row", processes=0)
    seen = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        for b in loader:
            seen += b["index"].tolist()
    assert len(seen) == 3 * ROWS
    # It never climbs past where it started on a store that saturates at 12 (it starts high: see reader).
    assert 12 <= loader.stats()["concurrency"] <= TUNER_START


def test_auto_backs_off_a_throttling_store(seg_url) -> None:
    src = CapacitySource(seg_url, slots=64, latency=0.05, throttle_above=8)  # throttles above 8 in flight
    loader = AsyncLoader(src, batch_size=8, concurrency="auto", read_mode="row", processes=0)
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert sorted(i for b in loader for i in b["index"].tolist()) == list(range(ROWS))
    assert src.throttled > 0
    assert loader.stats()["concurrency"] <= 16


def test_a_flat_latency_keeps_the_climb_going_through_noisy_throughput() -> None:
    """A remote store: latency stays at the round trip until the store saturates at 600 in flight;
    throughput measured with ±15% noise. Throughput alone would stop the climb on a noisy interval."""
    import random

    rng = random.Random(1)
    rtt, knee = 0.05, 600

    def observe(limit: int) -> Observation:
        latency = rtt * max(1.0, limit / knee)
        return Observation(limit / latency * rng.uniform(0.85, 1.15), latency_s=latency)

    t = ConcurrencyTuner(start=32, high=1024)
    t.observe(Observation(100.0, throttled=1))  # an early 503 ends slow start: only +25% probes remain
    for _ in range(60):
        t.observe(observe(t.samples))
    assert t.samples >= 512  # within 10% of the best throughput (knee at 600)


def test_littles_law_floor_goes_to_what_covers_the_latency_in_one_step() -> None:
    """Decoders that could assemble 3,000 samples/s behind a 100 ms round trip need ~450 in flight
    (headroom 1.5): the tuner goes there at once, and neither a step that did not pay nor a hold takes
    it below."""
    t = ConcurrencyTuner(start=16, low=8, high=4096)
    assert t.observe(Observation(150.0, latency_s=0.1, assemble_rate=3000.0)) == 450
    assert t.history[-1][2].startswith("Little's law")
    for _ in range(20):  # throughput flat whatever is in flight: steps do not pay
        assert t.observe(Observation(2000.0, latency_s=0.1, assemble_rate=3000.0)) >= 450
    assert t.observe(Observation(2000.0, latency_s=0.02, assemble_rate=3000.0)) >= 90  # a shorter trip: lower
    assert t.little(Observation(10.0)) == 8  # nothing measured: the lower bound


def test_littles_law_floor_stays_below_where_a_store_throttled() -> None:
    t = ConcurrencyTuner(start=400, low=1, high=4096)
    assert t.observe(Observation(500.0, throttled=2, latency_s=0.1, assemble_rate=3000.0)) == 200
    for _ in range(10):
        assert t.observe(Observation(500.0, latency_s=0.1, assemble_rate=3000.0)) <= 250  # probes at most +25%


def test_littles_law_uses_the_round_trip_not_the_queueing_and_not_when_consumer_bound() -> None:
    t = ConcurrencyTuner(start=64, low=1, high=4096)
    assert t.observe(Observation(1000.0, latency_s=0.05, assemble_rate=2000.0)) == 150
    # a saturated store: latency 0.4 s from queueing; the floor stays at the 50 ms round trip's
    assert t.little(Observation(1000.0, latency_s=0.4, assemble_rate=2000.0)) == 150
    held = t.samples
    assert t.observe(Observation(1000.0, consumer_bound=True, latency_s=0.05, assemble_rate=20000.0)) == held
