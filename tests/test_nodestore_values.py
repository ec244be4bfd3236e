"""The node block store gives back exactly what a miss gives: every column type Deep Lake and a user's
source return (text, scalars, JSON, ragged arrays, bytes, datetimes, structured and 0-d values) comes out of
a warm epoch (every row from the store) identical in type, dtype and shape to the cold one, and a value
that cannot be kept exactly makes the source read through, said once."""

from __future__ import annotations

import datetime
import logging
from typing import Any

import numpy as np
import pytest
import torch

from asyncload import AsyncLoader, DeepLakeSource
from asyncload.nodestore import decode, encode
from asyncload.sources.base import Columns, Source

pytestmark = pytest.mark.timeout(120)

ROWS = 48
OPTS = {"shuffle": True, "seed": 3, "batch_size": 8, "cache": True, "processes": 0}


def described(value: Any) -> Any:
    """What a batch's value is, in full: type, dtype, shape and content, for tensors, arrays and lists."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.numpy().tobytes())
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.descr, value.shape, value.tobytes())
    if isinstance(value, np.generic):
        return ("scalar", type(value).__name__, value.dtype.descr, value.tobytes())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [described(v) for v in value])
    if isinstance(value, dict):
        return ("dict", {k: described(v) for k, v in value.items()})
    return (type(value).__name__, value)


def by_index(batches: list[dict[str, Any]]) -> dict[int, Any]:
    """Each batch described, keyed by its first index (the same order in both epochs: one seed, one epoch)."""
    return {int(b["index"][0]): {k: described(v) for k, v in b.items()} for b in batches}


def cold_then_warm(source: Source[Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    loader = AsyncLoader(source, **OPTS)
    cold = list(loader)
    assert loader.stats()["node_misses"] == ROWS
    loader.close()
    again = AsyncLoader(source, **OPTS)  # a new loader: every row from the store
    warm = list(again)
    stats = again.stats()
    again.close()
    return cold, warm, stats


@pytest.fixture
def many_types(tmp_path) -> str:
    import deeplake

    url = "file://" + str(tmp_path / "types")
    ds = deeplake.create(url)
    ds.add_column("name", deeplake.types.Text())
    ds.add_column("label", deeplake.types.Int32())
    ds.add_column("score", deeplake.types.Float32())
    ds.add_column("emb", deeplake.types.Array("float32", dimensions=1))
    ds.add_column("blob", deeplake.types.Bytes())
    ds.add_column("grid", deeplake.types.Array("uint8", shape=[2, 3]))
    rng = np.random.default_rng(0)
    ds.append({
        "name": [f"img_{i:04d}.png" for i in range(ROWS)],
        "label": list(range(ROWS)),
        "score": [np.float32(i) / 7 for i in range(ROWS)],
        "emb": [rng.random(1 + i % 5, dtype=np.float32) for i in range(ROWS)],
        "blob": [bytes([i]) * (1 + i % 3) for i in range(ROWS)],
        "grid": [np.full((2, 3), i, np.uint8) for i in range(ROWS)],
    })  # fmt: skip
    ds.commit()
    return url


@pytest.mark.parametrize("read_mode", ["row", "column"])
def test_every_deep_lake_column_type_is_the_same_on_a_hit_as_on_a_miss(many_types, read_mode) -> None:
    src = DeepLakeSource(many_types, columns=("name", "label", "score", "emb", "blob", "grid"))
    opts = {**OPTS, "read_mode": read_mode, "ragged": "list"}
    loader = AsyncLoader(src, **opts)
    cold = list(loader)
    loader.close()
    again = AsyncLoader(src, **opts)
    warm = list(again)
    assert again.stats()["node_hits"] == ROWS and again.stats()["remote_bytes"] == 0
    again.close()
    assert by_index(cold) == by_index(warm)
    first = cold[0]
    assert isinstance(first["name"], list) and isinstance(first["name"][0], str)
    assert first["label"].shape == (8,) and first["grid"].shape == (8, 2, 3)


class Odd(Source[None]):
    """A user's source whose columns hold what no image store does: datetimes, structured records, 0-d
    arrays, Python values, ragged lists and strings."""

    def __init__(self) -> None:
        super().__init__("odd://values", ("when", "rec", "zero", "meta", "ragged", "text"))

    def _open(self) -> None:
        return None

    def _length(self, handle: None) -> int:
        return ROWS

    def _version(self, handle: None) -> str:
        return "v1"

    @property
    def local(self) -> bool:
        return False

    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        rec = np.dtype([("x", "<i4"), ("y", "<f8")])
        return {
            "when": [np.datetime64("2026-01-01") + np.timedelta64(i, "D") for i in indices],
            "rec": [np.array((i, i / 2), dtype=rec) for i in indices],
            "zero": [np.array(i, np.int16) for i in indices],
            "meta": [{"id": i, "tags": ["a"] * (i % 3), "when": datetime.date(2026, 1, 1 + i % 28)} for i in indices],
            "ragged": [[np.arange(k, dtype=np.int64) for k in range(i % 4)] for i in indices],
            "text": np.array([f"r{i}" for i in indices]),
        }


def test_a_users_odd_values_are_the_same_on_a_hit_as_on_a_miss() -> None:
    src = Odd()
    opts = {**OPTS, "ragged": "list", "collate_fn": lambda samples: samples}
    cold = AsyncLoader(src, **opts)
    first = list(cold)
    cold.close()
    warm = AsyncLoader(src, **opts)
    second = list(warm)
    assert warm.stats()["node_hits"] == ROWS
    warm.close()
    assert [[described(s) for s in b] for b in first] == [[described(s) for s in b] for b in second]


def test_values_round_trip_exactly() -> None:
    values = [
        b"\x00bytes", "text ünï", np.int32(5), np.float64(0.5), np.array(3, np.int16),
        np.zeros((0, 3), np.float32), np.arange(6, dtype=">u2").reshape(2, 3),
        np.array(["2026-01-01T10:00"], "datetime64[m]"), np.array([(1, 2.0)], [("a", "<i4"), ("b", "<f8")]),
        np.array([(1, 2.0)], [("a", "<i4"), ("b", "<f8")])[0], np.timedelta64(3, "s"),
        {"k": [1, 2]}, [np.arange(2), np.arange(3)], None, 7, 2.5, True,
        np.array([1, None], dtype=object), np.arange(12)[::3],
    ]  # fmt: skip
    for v in values:
        data, how = encode(v)
        back = decode(bytearray(bytes(data)), how)
        assert described(back) == described(v) or (isinstance(v, np.ndarray) and v.dtype == object), v
        assert type(back) is type(v), v


class Unpicklable:
    def __reduce__(self):
        raise TypeError("no pickling here")


class Opaque(Odd):
    async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Columns:
        return {c: [Unpicklable() if c == "meta" else i for i in indices] for c in self.columns}


def test_a_value_that_cannot_be_kept_reads_through_said_once(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="asyncload")
    src = Opaque()
    loader = AsyncLoader(src, **{**OPTS, "collate_fn": lambda samples: samples})
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert sorted(s["index"] for b in loader for s in b) == list(range(ROWS))
    said = [r.getMessage() for r in caplog.records if "not kept on the node block store" in r.getMessage()]
    assert len(said) == 1 and "Unpicklable cannot be pickled" in said[0], said
    assert loader.stats()["node_hits"] == 0
    loader.close()
