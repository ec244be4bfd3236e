"""``LoaderOptions``: validated once, frozen, refused by name when misspelt, the one value every epoch
shape (in-process, fan-out workers, the torch adapter) is built from."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from asyncload import ConfigError, LoaderOptions, Shard


def test_defaults_are_valid_and_frozen() -> None:
    o = LoaderOptions()
    assert (o.batch_size, o.concurrency, o.prefetch, o.read_mode, o.processes) == (32, "auto", 4, "auto", "auto")
    assert (o.max_restarts, o.mp_context) == (3, "forkserver")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.batch_size = 8  # type: ignore[misc]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"batch_size": 0}, "batch_size=0 is not allowed: an int >= 1"),
        ({"concurrency": "fast"}, "concurrency='fast' is not allowed: 'auto' or an int >= 1"),
        ({"read_mode": "chunk"}, "read_mode='chunk' is not allowed: 'auto', 'row' or 'column'"),
        ({"hedge": 1.0}, "hedge=1.0 is not allowed: None or a factor > 1"),
        ({"mp_context": "fork"}, "mp_context='fork' is not allowed: 'spawn' or 'forkserver' (never 'fork'"),
        ({"ragged": {"images": "crop"}}, "ragged={'images': 'crop'} is not allowed: None, 'list', 'pad' or a dict"),
        ({"bach_size": 8}, "bach_size=8 is not allowed: no such option; did you mean 'batch_size'?"),
    ],
)
def test_a_bad_setting_is_refused_naming_setting_value_and_what_is_allowed(settings, message) -> None:
    with pytest.raises(ConfigError) as info:
        LoaderOptions.of(settings)
    assert str(info.value).startswith(message)


def test_replace_validates_again_and_of_builds_on_a_base() -> None:
    base = LoaderOptions.of({"batch_size": 8, "seed": 3})
    assert LoaderOptions.of({}, base) is base
    more = LoaderOptions.of({"prefetch": 2}, base)
    assert (more.batch_size, more.seed, more.prefetch) == (8, 3, 2) and base.prefetch == 4
    with pytest.raises(ConfigError, match="prefetch=0 is not allowed"):
        base.replace(prefetch=0)


def test_options_pickle_whole_for_worker_processes() -> None:
    o = LoaderOptions.of({"batch_size": 16, "ragged": {"masks": "pad"}, "processes": 2})
    back = pickle.loads(pickle.dumps(o))
    assert back == o and back.ragged == {"masks": "pad"}


def test_the_sampler_is_the_plan_these_options_cut() -> None:
    o = LoaderOptions.of({"batch_size": 4, "shuffle": True, "seed": 7, "drop_last": True})
    plan = o.sampler(18, Shard(rank=1, world_size=2))
    batches = plan.batches(0)
    assert len(batches) == len(plan) == 2 and all(len(b) == 4 for b in batches)
    assert plan.batches(0) == o.sampler(18, Shard(rank=1, world_size=2)).batches(0)  # seeded: reproducible
    other = o.sampler(18, Shard(rank=0, world_size=2)).batches(0)
    assert not set().union(*map(set, batches)) & set().union(*map(set, other))  # ranks never share a row
