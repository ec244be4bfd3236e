"""on_error: "raise" stops the epoch with a named error; "skip" leaves out only the bad samples, counts
and reports them, and never shortens an epoch otherwise."""

from __future__ import annotations

import logging

import pytest

from asyncload import AsyncLoader, ReadError

from .conftest import ROWS, wait_no_loop_threads
from .sources import FailingSource

pytestmark = pytest.mark.timeout(60)
BAD = {5, 77, 150}


def test_raise_is_the_default_and_names_the_sample(seg_url) -> None:
    loader = AsyncLoader(FailingSource(seg_url, BAD), batch_size=8, read_mode="row")
    with pytest.raises(ReadError) as e:
        list(loader)
    assert isinstance(e.value, OSError)
    assert e.value.indices == [5]
    assert str(e.value) == f"reading {seg_url} at indices [5] failed: OSError: unreadable object for sample 5"
    wait_no_loop_threads()


@pytest.mark.parametrize("read_mode", ["row", "column"])
def test_skip_leaves_out_exactly_the_bad_samples_and_reports_them(seg_url, read_mode, caplog) -> None:
    loader = AsyncLoader(FailingSource(seg_url, BAD), batch_size=8, read_mode=read_mode, on_error="skip")
    with caplog.at_level(logging.WARNING, logger="asyncload"):
        got = [i for b in loader for i in b["index"].tolist()]
    assert got == [i for i in range(ROWS) if i not in BAD]
    s = loader.stats()
    assert s["skipped"] == 3
    assert [i for i, _ in s["skipped_samples"]] == sorted(BAD) or sorted(i for i, _ in s["skipped_samples"]) == sorted(
        BAD
    )
    assert all("OSError: unreadable object for sample" in why for _, why in s["skipped_samples"])
    assert s["samples_yielded"] == ROWS - 3
    assert any("skipped 3 samples in epoch 0" in r.getMessage() and seg_url in r.getMessage() for r in caplog.records)


def test_skip_covers_transform_failures_and_whole_bad_batches(seg_url) -> None:
    def transform(sample):
        if sample["index"] in range(8, 16):  # the whole second batch
            raise ValueError("corrupt image")
        return sample

    loader = AsyncLoader(FailingSource(seg_url, set()), batch_size=8, transform=transform, on_error="skip")
    batches = [b["index"].tolist() for b in loader]
    assert [i for b in batches for i in b] == [i for i in range(ROWS) if i not in range(8, 16)]
    assert all(batches)  # an all-bad batch is left out, not yielded empty
    s = loader.stats()
    assert s["skipped"] == 8 and all(why == "ValueError in transform: corrupt image" for _, why in s["skipped_samples"])
    assert loader.state_dict()["next"] == 26  # the left-out batch still counts as consumed
