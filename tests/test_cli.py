"""The asyncload command and the validated configs, on a small dataset."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import deeplake
import pytest

from asyncload import AsyncLoader, DeepLakeSource, make_dataset
from asyncload.tools.cli import main

from .sources import DelayedSource

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def test_make_inspect_load(tmp_path, capsys) -> None:
    path = tmp_path / "small"
    assert main(["make-dataset", str(path), "--rows", "24", "--size", "32", "--format", "jpg"]) == 0
    ds = deeplake.open_read_only(f"file://{path}")
    assert len(ds) == 24 and [c.name for c in ds.schema.columns] == ["images", "masks"]
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"file://{path}: 24 rows" in out
    assert "images" in out and "(32, 32, 3)" in out and "(32, 32)" in out
    assert "    metadata: class_names=['background', 'circle', 'rectangle', 'triangle']" in out  # what train reads
    assert main(["load", str(path), "--batch-size", "8", "--sequential-rows", "8"]) == 0
    out = capsys.readouterr().out
    assert "| sequential ds[i][col] (8 rows) | 8 |" in out
    assert "| asyncload column reads, concurrency auto | 24 |" in out  # auto: columns where asyncload decodes


def tagged_dataset(tmp_path: Path) -> tuple[Path, Any]:
    """A 12-row dataset made by the CLI, tagged "first", then 3 rows more committed: 15 at the head."""
    path = tmp_path / "v"
    assert main(["make-dataset", str(path), "--rows", "12", "--size", "16"]) == 0
    ds = deeplake.open(f"file://{path}")
    ds.tag("first")
    ds.append({"images": [ds[0]["images"]] * 3, "masks": [ds[0]["masks"]] * 3})
    ds.commit("3 more")
    return path, ds


def test_version_query_and_program_version(tmp_path, capsys) -> None:
    from asyncload import __version__

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"asyncload {__version__}\n"
    path, ds = tagged_dataset(tmp_path)
    capsys.readouterr()
    assert main(["inspect", str(path), "--version", "first"]) == 0
    assert f"file://{path} at version first: 12 rows" in capsys.readouterr().out
    assert main(["inspect", str(path), "--query", "SELECT * LIMIT 5"]) == 0
    out = capsys.readouterr().out
    assert f"file://{path}: 15 rows" in out and "query 'SELECT * LIMIT 5': 5 rows" in out
    assert main(["load", str(path), "--version", "first", "--batch-size", "4", "--sequential-rows", "4"]) == 0
    assert "| asyncload column reads, concurrency auto | 12 |" in capsys.readouterr().out


def test_the_sequential_baseline_reads_the_version_and_the_query_rows(tmp_path, capsys) -> None:
    """The baseline reads what the loader reads: 12 rows at tag "first" (15 at the head), 5 of a query."""
    path, ds = tagged_dataset(tmp_path)
    capsys.readouterr()
    assert main(["load", str(path), "--version", "first", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert (
        "| sequential ds[i][col] (12 rows) | 12 |" in out and "| asyncload column reads, concurrency auto | 12 |" in out
    )
    assert main(["load", str(path), "--query", "SELECT * LIMIT 5", "--batch-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "| sequential ds[i][col] (5 rows) | 5 |" in out and "| asyncload column reads, concurrency auto | 5 |" in out


def creds_file(tmp_path, remote_data) -> Path:
    """The server's keys in a JSON file, as ``--creds`` takes them."""
    import json

    path = tmp_path / "creds.json"
    path.write_text(json.dumps(remote_data.server.creds()))
    return path


def test_the_sequential_baseline_uses_the_creds(remote_data, tmp_path, capsys) -> None:
    creds = creds_file(tmp_path, remote_data)
    url = remote_data.deeplake_url
    assert main(["load", url, "--creds", str(creds), "--batch-size", "4", "--sequential-rows", "6"]) == 0
    out = capsys.readouterr().out
    assert "| sequential ds[i][col] (6 rows) | 6 |" in out and remote_data.server.secret_key not in out


@pytest.mark.timeout(180)
def test_load_compares_decode_read_mode_and_processes(small, capsys) -> None:
    """A user can time each path on their own data: where images decode, how reads are cut, and reader
    processes; each row of the table says what it ran with."""
    assert main(["load", str(small), "--batch-size", "8", "--decode", "store", "--read-mode", "row",
                 "--processes", "0"]) == 0  # fmt: skip
    assert "| asyncload row reads, concurrency auto, decode store, processes 0 | 20 |" in capsys.readouterr().out
    assert main(["load", str(small), "--batch-size", "8", "--decode", "cpu", "--processes", "2"]) == 0
    assert "| asyncload column reads, concurrency auto, decode cpu, processes 2 | 20 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--processes", "-1"], "argument --processes: processes='-1' is not allowed: 'auto' or an int >= 0"),
        (["--decode", "gpu"], "decode='gpu' is not allowed: 'auto', 'cpu', 'store', 'cuda' or 'cuda:N'"),
    ],
)
def test_bad_decode_or_processes_are_named(small, capsys, argv: list[str], message: str) -> None:
    try:
        code = main(["load", str(small), *argv])
    except SystemExit as done:
        code = done.code
    assert code == 2 and message in capsys.readouterr().err


# -- bad input: one line on stderr, exit 2 (usage) or 1 (data, I/O), the traceback only when asked ----------


@pytest.fixture(autouse=True)
def _no_debug_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's ASYNCLOAD_DEBUG=1 must not turn the one-line checks below into tracebacks."""
    monkeypatch.delenv("ASYNCLOAD_DEBUG", raising=False)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 20-row dataset (columns images, masks): shorter than the baseline's default 500 rows."""
    path = tmp_path_factory.mktemp("cli") / "small"
    make_dataset(str(path), 20, height=16, width=16, progress=False)
    return path


def one_line(err: str) -> str:
    """The only line of ``err``, which must not hold a traceback."""
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_inspect_of_a_missing_dataset_is_one_line_and_exit_1(tmp_path, capsys) -> None:
    assert main(["inspect", str(tmp_path / "none")]) == 1
    line = one_line(capsys.readouterr().err)
    assert line == f"asyncload inspect: no Deep Lake dataset at file://{tmp_path / 'none'}"


def test_load_of_a_missing_dataset_is_one_line_and_exit_1(tmp_path, capsys) -> None:
    assert main(["load", str(tmp_path / "none")]) == 1
    captured = capsys.readouterr()
    assert one_line(captured.err) == f"asyncload load: no Deep Lake dataset at file://{tmp_path / 'none'}"
    assert "sequential" not in captured.out  # failed before the baseline, as asyncload's own error
    assert main(["--debug", "load", str(tmp_path / "none")]) == 1  # --debug before the subcommand
    err = capsys.readouterr().err
    assert "Traceback" in err and "DatasetNotFoundError" in err
    assert err.splitlines()[-1] == f"asyncload load: no Deep Lake dataset at file://{tmp_path / 'none'}"


def test_load_with_a_misspelt_column_names_it_and_the_columns_there(small, capsys, monkeypatch) -> None:
    assert main(["load", str(small), "--columns", "images,maks"]) == 1
    assert one_line(capsys.readouterr().err) == (
        f"asyncload load: column 'maks' is not in Deep Lake dataset file://{small} (its columns: images, masks)"
    )
    monkeypatch.setenv("ASYNCLOAD_DEBUG", "1")
    assert main(["load", str(small), "--columns", "images,maks"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "ColumnNotFoundError" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("debug", [None, "--debug", "ASYNCLOAD_DEBUG=1"])
def test_load_batch_size_0_is_a_usage_error_exit_2(small, tmp_path, debug) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ASYNCLOAD_DEBUG"}
    argv = [sys.executable, "-m", "asyncload", "load", str(small), "--batch-size", "0"]
    if debug == "--debug":
        argv.append(debug)  # after the subcommand works too
    elif debug:
        env["ASYNCLOAD_DEBUG"] = "1"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=50, cwd=tmp_path, env=env)
    assert done.returncode == 2 and "sequential" not in done.stdout  # checked before anything is timed
    line = "asyncload load: batch_size=0 is not allowed: an int >= 1"
    if debug is None:
        assert one_line(done.stderr) == line
    else:
        assert "Traceback" in done.stderr and "ConfigError" in done.stderr
        assert done.stderr.splitlines()[-1] == line


@pytest.mark.timeout(60)
def test_train_with_a_missing_config_file_is_one_line_and_exit_1(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ASYNCLOAD_DEBUG"}
    done = subprocess.run(
        [sys.executable, "-m", "asyncload", "train", "--config", "missing.yaml"],
        capture_output=True, text=True, timeout=50, cwd=tmp_path, env=env,
    )  # fmt: skip
    assert done.returncode == 1
    assert one_line(done.stderr) == (
        "asyncload train: missing.yaml: No such file or directory, nor a shipped config of that name "
        "(train_unet, train_unet_photos)"
    )


def test_a_bad_argument_is_one_line_and_exit_2(small, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main(["load", str(small), "--batch-size", "x"])
    assert done.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert line == "asyncload load: argument --batch-size: invalid int value: 'x' (see asyncload load --help)"


def test_ctrl_c_exits_130_quietly(small, capsys, monkeypatch) -> None:
    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr("asyncload.tools.cli._cmd_inspect", interrupted)
    assert main(["inspect", str(small)]) == 130
    assert capsys.readouterr().err == ""


def test_load_names_the_baseline_after_the_rows_it_read(small, capsys) -> None:
    assert main(["load", str(small), "--batch-size", "8"]) == 0  # --sequential-rows 500, 20 rows there
    out = capsys.readouterr().out
    assert "| sequential ds[i][col] (20 rows) | 20 |" in out and "500 rows" not in out


def test_every_subcommand_has_help() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "asyncload", "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for cmd in ("make-dataset", "inspect", "load", "bench", "train", "demo"):
        assert cmd in out
    for cmd in ("make-dataset", "inspect", "load", "bench", "train", "demo"):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        assert e.value.code == 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "epoch_s=-1"], "epoch_s=-1.0 is not allowed: seconds > 0"),
        (["--set", "concurency=8"], "concurency"),
        (["--set", "baseline=nobody"], "baseline='nobody' is not allowed: one of"),
        (["--set", "datasets={jpeg: {rows: 10}}"], "datasets.jpeg: rows=10 is not allowed: an int >= 64"),
    ],
)
def test_bench_config_errors_name_key_value_and_allowed(args, message, capsys) -> None:
    assert (
        main(
            [
                "bench",
                "--config",
                str(ROOT / "configs" / "bench_wan.yaml"),
                "--suite",
                str(ROOT / "benchmarks" / "suites" / "wan.py"),
                *args,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert message in err


def test_shipped_configs_are_valid() -> None:
    from benchmarks.suites.wan import load_suite_config

    names = sorted(p.name for p in (ROOT / "configs").glob("bench_*.yaml"))
    assert {"bench_wan.yaml", "bench_wan_large.yaml", "bench_augment.yaml"} <= set(names)
    for name in names:
        load_suite_config(str(ROOT / "configs" / name), [])


def test_live_stats_and_the_periodic_log_line(seg_url, caplog) -> None:
    # each read takes 0.2 s, so an epoch (203 rows at the tuner's start of 128 in flight) outlasts log_every
    loader = AsyncLoader(DelayedSource(seg_url, lambda idx: 0.2), batch_size=16, concurrency="auto", log_every=0.1)
    with caplog.at_level(logging.INFO, logger="asyncload"):
        for epoch in range(3):
            loader.set_epoch(epoch)
            for _ in loader:
                pass
    s = loader.stats()
    for key in (
        "samples_per_s",
        "bytes_per_s",
        "in_flight",
        "ready_batches",
        "read_p50_ms",
        "read_p90_ms",
        "read_p99_ms",
        "consumer_wait_s",
        "retries",
        "hedges",
        "skipped",
        "concurrency",
        "concurrency_setting",
    ):
        assert key in s, key
    assert s["bytes_per_s"] > 0 and s["concurrency"] >= 1 and s["concurrency_setting"] == "auto"
    assert s["read_p50_ms"] <= s["read_p90_ms"] <= s["read_p99_ms"]
    lines = [r.getMessage() for r in caplog.records if "samples/s" in r.getMessage()]
    assert lines and seg_url in lines[0] and "in flight (limit" in lines[0]


def test_inspect_a_dataset_on_s3_with_creds_and_a_query(remote_data, tmp_path, capsys) -> None:
    creds = creds_file(tmp_path, remote_data)
    url = remote_data.deeplake_url
    assert main(["inspect", url, "--creds", str(creds), "--query", "SELECT * LIMIT 7", "--sample", "3"]) == 0
    out = capsys.readouterr().out
    assert f"{url}: {remote_data.rows} rows" in out and "query 'SELECT * LIMIT 7': 7 rows" in out and "images" in out
    assert remote_data.server.secret_key not in out
    assert main(["inspect", url]) == 1  # no credentials: a one-line error naming the URL, not a traceback
    line = one_line(capsys.readouterr().err)
    assert line.startswith("asyncload inspect: ") and url in line


def test_load_reads_a_mixture(small, tmp_path, capsys) -> None:
    """``--mix URL=WEIGHT``: the URL and another dataset as one ``MixedSource``; the baseline reads the
    mixture's rows one at a time; a mixture's own flags without ``--mix`` are refused."""
    other = tmp_path / "other"
    make_dataset(str(other), 12, height=16, width=16, seed=3, progress=False)
    argv = ["load", str(small), "--mix", f"{other}=0.5", "--weight", "1.5", "--epoch-rows", "40"]
    assert main([*argv, "--batch-size", "8", "--sequential-rows", "6", "--processes", "0"]) == 0
    out = capsys.readouterr().out
    assert "| sequential reads, one row at a time (6 rows) | 6 |" in out
    assert "| asyncload column reads, concurrency auto, processes 0 | 40 |" in out
    assert "MixedSource" in out and "mix(small=file://" in out
    assert main(["load", str(small), "--epoch-rows", "40"]) == 2  # a usage error
    assert "--weight and --epoch-rows are not allowed without --mix" in capsys.readouterr().err


def test_the_baseline_does_the_work_the_loader_does(seg_url) -> None:
    """``asyncload load``'s baseline shapes each row as the loader's settings do (issue 63: it decoded but did
    not resize, and the ratio compared different work): the same draw per row, the same crop, resize and
    flip, to the pixel, and the report names that work."""
    import numpy as np

    from asyncload import RandomHorizontalFlip, Resize
    from asyncload.tools.baseline import Shaper, roles_of

    settings = {"augment": [Resize((24, 32)), RandomHorizontalFlip()], "seed": 3}
    loader = AsyncLoader(DeepLakeSource(seg_url), 8, processes=0, decode="cpu", **settings)
    with loader:
        batch = next(iter(loader))
    src = DeepLakeSource(seg_url)
    shaper = Shaper(settings, roles_of(src.open()))
    assert shaper.work == "decodes each row, then resizes and flips it as the loader's settings do"
    ds = src.dataset()
    for k, i in enumerate(batch["index"].tolist()):
        got = shaper.row({c: np.array(ds[i][c]) for c in ("images", "masks")}, i, 0)
        assert np.array_equal(got["images"], batch["images"][k].numpy()), i
        assert np.array_equal(got["masks"], batch["masks"][k].numpy()), i
    src.close()
    assert Shaper({}, {"images": "image"}).work == "decodes each row"


def test_load_of_files_reports_the_bytes_received_and_shapes_the_baseline_alike(remote_data, tmp_path, capsys) -> None:
    """Files under a prefix: the baseline GETs, decodes and resizes each row as the loader does; the table's
    bytes are what the GETs received (the files' bytes), with the node store off as with it on."""
    import json

    from .test_figures import wire_bytes

    creds = creds_file(tmp_path, remote_data)
    for cache in ("on", "off"):
        argv = ["load", remote_data.files_url, "--creds", str(creds), "--batch-size", "16", "--resize", "24",
                "--sequential-rows", "8", "--cache", cache, "--json"]  # fmt: skip
        assert main(argv) == 0
        doc = json.loads(capsys.readouterr().out)
        base, ours = doc["readers"]
        assert doc["baseline_work"] == "decodes each row, then resizes it as the loader's settings do"
        assert (base["samples"], ours["samples"]) == (8, remote_data.rows)
        assert ours["remote_bytes"] == wire_bytes(remote_data, remote_data.rows), cache
        assert doc["remote_bytes_counts"] == "the bytes the GETs received from the store, as they crossed the wire"
