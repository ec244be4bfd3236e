"""``concurrency="auto"``: how many samples to keep in flight, found online from what the loader measures.

Why not a fixed number: the best concurrency is roughly throughput × latency (Little's law), and both
change with the store, the network, the decoder and the consumer. Too few reads in flight leave the
network idle; too many cost memory and, on a throttling store, provoke 503/429s.

The tuner is a small hill-climber with a slow start, in the spirit of TCP congestion control and
tf.data's AUTOTUNE, fed once per interval with what the pipeline saw:

- **Slow start:** double while each doubling still pays: throughput rose by more than ``gain``, or read
  latency stayed near its floor (no queueing yet, as in TCP Vegas), which is the steadier signal on a
  noisy machine: on a remote store latency stays at the round trip until something saturates.
- **Plateau:** when a step up does not pay, step back to the last level that did, and hold. Every
  ``probe_every`` intervals it probes one step (×1.25) up, so it follows a store that got faster; while
  latency sits at its floor it probes at once (nothing is queueing, so more in flight is free).
- **Consumer-bound:** when the consumer is the bottleneck (every batch slot is taken, nothing waits
  on reads), more concurrency cannot help: hold.
- **Back-off:** a throttling answer (503 SlowDown, 429) halves the samples in flight at once (multiplicative
  decrease), and the climb restarts from there more carefully.
- **Little's law floor:** the pipeline also reports the rate its CPU pool could assemble at (threads over
  CPU seconds per sample, measured) and the read latency. Samples in flight below ``headroom`` × that rate
  × the round trip (the lowest latency seen: not queueing) cannot keep the decoders busy whatever the store
  does, so the tuner goes there in one step rather than by doublings, and never probes or backs off below
  it. A throttling store still halves it,
  and the floor stays below half of where the store last throttled (the climb may probe past it). At
  100 ms and 3,000 samples/s of decode the floor is 450 in flight, where doublings from 16 would take five
  intervals to get.

The decisions are a pure function of the observations, so they are tested without timing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Observation:
    """What the pipeline measured over one interval at the current samples in flight."""

    samples_per_s: float
    consumer_bound: bool = False
    throttled: int = 0
    latency_s: float | None = None  # median read latency over the interval
    assemble_rate: float | None = None  # samples/s the CPU pool could assemble at (None: not measured yet)


class ConcurrencyTuner:
    """Chooses the number of samples in flight between ``low`` and ``high``."""

    def __init__(
        self,
        start: int = 16,
        low: int = 1,
        high: int = 512,
        gain: float = 0.08,
        probe_every: int = 8,
        headroom: float = 1.5,
    ) -> None:
        self.low, self.high = max(1, low), max(1, high)
        self.samples = min(max(start, self.low), self.high)
        self.gain = gain
        self.probe_every = probe_every
        self.headroom = headroom
        self.floor = self.low  # Little's law: the samples in flight the last observation said are needed
        self._throttled_at = self.high  # the floor never returns to where a store throttled (half of it)
        self.slow_start = True
        self._prev_samples: int | None = None  # the level before the last step up
        self._prev_rate = 0.0  # its throughput
        self._best: dict[int, float] = {}
        self._held = 0
        self._floor: float | None = None  # the lowest median read latency seen: the unloaded round trip
        self._floor_samples = 0  # the samples in flight it was seen at
        self.history: list[tuple[int, float, str]] = []

    def little(self, obs: Observation) -> int:
        """Samples in flight that cover the round trip at ``obs``'s assembly rate (``headroom`` over), within
        the bounds; ``low`` where either is not measured. The round trip is the lowest read latency seen, not
        this interval's: latency that grew with queueing at a saturated store would otherwise ask for more
        in flight, which would queue more."""
        if not obs.assemble_rate or not obs.latency_s:
            return self.low
        trip = min(obs.latency_s, self._floor or obs.latency_s)
        return min(max(math.ceil(self.headroom * obs.assemble_rate * trip), self.low), self.high)

    def _set(self, samples: int, why: str, rate: float) -> int:
        if samples < self.floor:  # (no floor in an interval that throttled: ``observe`` sets it to 0)
            samples, why = self.floor, f"{why} (Little's law floor)"
        self.samples = min(max(int(samples), self.low), self.high)
        self.history.append((self.samples, rate, why))
        return self.samples

    def _up(self, samples: int) -> int:
        """One step up: double in slow start, then +25%."""
        return samples * 2 if self.slow_start else math.ceil(samples * 1.25)

    def observe(self, obs: Observation) -> int:
        """Feed one interval's figures; returns the samples in flight for the next interval."""
        rate, samples = obs.samples_per_s, self.samples
        self._best[samples] = max(self._best.get(samples, 0.0), rate)
        unloaded = False
        if obs.latency_s is not None and obs.latency_s > 0:
            if self._floor is None or obs.latency_s < self._floor:
                self._floor, self._floor_samples = obs.latency_s, samples
            # Evidence only once the samples in flight have grown past where the floor was seen without latency
            # following: starting high on a saturated store, the first latency is no floor at all.
            unloaded = samples > self._floor_samples and obs.latency_s <= 1.5 * self._floor
        # (a consumer slower than the reads gains nothing from more in flight: no floor then)
        self.floor = 0 if obs.throttled or obs.consumer_bound else min(self.little(obs), self._throttled_at)
        if self.floor > samples:
            self._prev_samples, self._held = None, 0
            return self._set(self.floor, "Little's law: cover the latency at the assembly rate", rate)
        if obs.throttled:
            self._throttled_at = samples // 2
            self.slow_start = False
            self._prev_samples, self._held = None, 0
            return self._set(samples // 2, "throttled: halve", rate)
        if obs.consumer_bound:
            self._prev_samples, self._held = None, 0
            return self._set(samples, "consumer-bound: hold", rate)
        if self._prev_samples is not None:
            # Judge the last step up: did it pay?
            if rate > self._prev_rate * (1 + self.gain) or (unloaded and rate >= self._prev_rate * 0.95):
                self._prev_samples, self._prev_rate = samples, rate
                return self._set(self._up(samples), "step paid: up", rate)
            back = self._prev_samples
            self.slow_start = False
            self._prev_samples, self._held = None, 0
            return self._set(back, "step did not pay: back", rate)
        self._held += 1
        if self.slow_start or self._held >= self.probe_every or unloaded:
            if samples >= self.high:
                return self._set(samples, "at the upper bound", rate)
            self._prev_samples, self._prev_rate, self._held = samples, rate, 0
            return self._set(self._up(samples), "probe up" if not self.slow_start else "slow start: up", rate)
        return self._set(samples, "hold", rate)
