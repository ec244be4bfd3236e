"""``asyncload load`` compares like with like (issue 53): every asyncload run's first epoch is cold (a
private, empty node store per run, removed after), also in a second invocation right after the first;
later epochs (``--epochs``) are reported apart, labelled warm, read from the node store. On the suite's
SeaweedFS, through a real S3 endpoint, with the loader's defaults (a Deep Lake reader process)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncload.tools.cli import main

pytestmark = pytest.mark.timeout(180)


def load(remote_data: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    creds = tmp_path / "creds.json"
    creds.write_text(json.dumps(remote_data.server.creds()))
    argv = ("load", remote_data.deeplake_url, "--creds", str(creds), "--batch-size", "16", "--json", *argv)
    assert main(list(argv)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def each_run(doc: dict[str, Any], part: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    sync, ours = (part or doc)["readers"]
    assert sync["name"].startswith("sequential ds[i][col]") and ours["name"].startswith("asyncload")
    return ours["each"]  # type: ignore[no-any-return]


def test_every_run_of_two_invocations_in_a_row_is_cold(remote_data, tmp_path, capsys) -> None:
    store = Path(tmp_path / "node-store")  # $ASYNCLOAD_CACHE_DIR of this test (conftest): the user's store
    runs = []
    for _ in range(2):  # the second invocation would find the first's blocks in a shared store
        doc = load(remote_data, tmp_path, capsys, "--repeat", "2", "--sequential-rows", "4")
        assert (
            doc["node_store"]["mode"] == "cold" and "private, empty node store per run" in doc["node_store"]["describe"]
        )
        assert "later_epochs" not in doc and doc["epochs"] == 1
        runs += each_run(doc)
    assert [(r["run"], r["epoch"]) for r in runs] == [(1, 1), (2, 1), (1, 1), (2, 1)]
    first = runs[0]["remote_bytes"]
    assert first > 50_000  # 96 rows of PNG images and masks, all from the server
    for r in runs:
        assert r["state"] == "cold" and r["node_hits"] == 0 and r["node_misses"] == remote_data.rows
        assert r["remote_bytes"] == pytest.approx(first, rel=0.05)  # each run fetched the dataset again
        assert r["waiting_on"] in ("training", "store", "decode", "augment", "transform", "collate")
        assert r["waiting_on_why"] and 0.0 <= r["consumer_wait_frac"] <= 1.0  # what the epoch waited on, and why
    st = doc["readers"][1]["cpu_ms_per_sample_by_stage"]  # the reader process's CPU is its own stage
    assert st["reader processes"] > 0 and st["decode"] > 0 and st["fetch"] > 0
    assert sum(st.values()) == pytest.approx(doc["readers"][1]["cpu_ms_per_sample"], rel=0.05)
    assert not store.exists() or not any(store.iterdir())  # the user's store untouched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("asyncload-cold-")] == []  # removed after


def test_later_epochs_are_reported_apart_as_warm_from_the_node_store(remote_data, tmp_path, capsys) -> None:
    doc = load(remote_data, tmp_path, capsys, "--epochs", "2", "--sequential-rows", "4")
    assert doc["epochs"] == 2
    (cold,) = each_run(doc)
    (warm,) = each_run(doc, doc["later_epochs"])
    assert (cold["epoch"], cold["state"], warm["epoch"], warm["state"]) == (1, "cold", 2, "warm")
    assert doc["readers"][1]["state"] == "cold" and doc["later_epochs"]["readers"][1]["state"] == "warm"
    assert doc["later_epochs"]["readers"][0]["state"] == "warm"  # the baseline's own epoch 2
    assert cold["remote_bytes"] > 50_000 and cold["node_hits"] == 0
    assert warm["remote_bytes"] < cold["remote_bytes"] / 100  # ~0: every row from the node store's disk
    assert warm["node_hits"] == remote_data.rows and warm["node_misses"] == 0 and warm["node_read_bytes"] > 0
    assert doc["speedup_epoch"] > 0 and doc["later_epochs"]["speedup_epoch"] > 0


def test_the_table_says_which_epochs_are_cold_and_which_warm(remote_data, tmp_path, capsys) -> None:
    creds = tmp_path / "creds.json"
    creds.write_text(json.dumps(remote_data.server.creds()))
    argv = ["load", remote_data.deeplake_url, "--creds", str(creds), "--batch-size", "16", "--epochs", "2",
            "--sequential-rows", "4", "--no-baseline"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert (
        "asyncload's node store: a private, empty node store per run (removed after): every run's epoch 1 is cold"
        in out
    )
    first, later = out.split("epoch 1 of each run")[1].split("epochs 2 of each run")
    assert "| cold |" in first and "| warm |" not in first
    assert "warm: asyncload reads what epoch 1 left in its node store" in later and "| warm |" in later


def test_your_own_store_is_respected_and_its_runs_labelled_by_what_they_found(remote_data, tmp_path, capsys) -> None:
    mine = tmp_path / "mine"
    doc = load(remote_data, tmp_path, capsys, "--repeat", "2", "--no-baseline", "--cache-dir", str(mine))
    assert doc["node_store"] == {
        "mode": "yours",
        "cache_dir": str(mine),
        "describe": f"the node store at {mine}, shared by the runs and kept: runs find what earlier ones left",
    }
    sync_less = doc["readers"]
    assert len(sync_less) == 1 and sync_less[0]["state"] == "mixed"
    one, two = sync_less[0]["each"]
    assert (one["state"], two["state"]) == ("cold", "warm") and two["node_hits"] == remote_data.rows
    assert any(mine.iterdir())  # kept


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cache", "off", "--warm"], "--cache off is not allowed with --cache-dir or --warm"),
        (["--cache-dir", "x", "--warm"], "--cache-dir and --warm are not allowed together"),
        (["--epochs", "0"], "--epochs=0 is not allowed: an int >= 1"),
    ],
)
def test_contradictory_store_flags_are_named(tmp_path, capsys, argv: list[str], message: str) -> None:
    assert main(["load", str(tmp_path / "any"), *argv]) == 2
    assert message in capsys.readouterr().err
