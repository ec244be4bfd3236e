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


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("500MB", 500 * 10**6), ("500 mb", 500 * 10**6), ("50GB", 50 * 10**9), ("2TB", 2 * 10**12),
        ("512MiB", 512 << 20), ("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("4 KiB", 4096),
        ("1kb", 1000), ("1024", 1024), ("64B", 64), (4096, 4096),
    ],
)  # fmt: skip
def test_one_rule_for_sizes_kb_is_1000_kib_and_k_are_1024(text, size) -> None:
    """``runtime.sizes.parse_size``: the rule of ``cache_limit``, ``memory_budget`` and ``--memory-budget``."""
    from asyncload.runtime.sizes import parse_size

    assert parse_size(text) == size


def test_memory_budget_and_cache_limit_take_the_same_sizes_and_the_cli_reads_them_alike() -> None:
    from asyncload.tools.cli import _bytes

    o = LoaderOptions(memory_budget="500MB", cache_limit="500MB")
    assert o.budget_bytes == o.cache_bytes == _bytes("500MB") == 500_000_000
    assert LoaderOptions(memory_budget="2GiB").budget_bytes == LoaderOptions(cache_limit="2G").cache_bytes == 2 << 30
    assert LoaderOptions(memory_budget=1 << 20).budget_bytes == 1 << 20
    for name in ("memory_budget", "cache_limit"):
        with pytest.raises(ConfigError) as info:
            LoaderOptions.of({name: "lots"})
        assert str(info.value).startswith(f"{name}='lots' is not allowed: 'auto' or a number of bytes >= 1 (an int, or")
        with pytest.raises(ConfigError, match=f"^{name}='0MB' is not allowed"):
            LoaderOptions.of({name: "0MB"})
