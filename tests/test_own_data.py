"""``asyncload load`` and ``asyncload train`` on a user's own data, through the installed command: photos
of many sizes with 5 classes (``user_photos``), as a local Deep Lake dataset and as plain files under a
prefix of a real SeaweedFS S3 server, a damaged JPEG among them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .user_photos import photo_folder, to_deeplake

ASYNCLOAD = str(Path(sys.executable).with_name("asyncload"))  # the installed console script
pytestmark = pytest.mark.timeout(180)


def run(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ASYNCLOAD, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=150)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """12 photos of 120-360 px a side, JPEG, and their 5-class PNG masks, in a folder."""
    return photo_folder(tmp_path_factory.mktemp("own") / "photos", 12, sizes=(120, 360))


def test_load_reads_photos_of_any_size_with_a_resize_and_reports_whole_epochs_as_json(
    photos: Path, tmp_path: Path
) -> None:
    url = to_deeplake(photos, f"file://{tmp_path / 'seg'}")
    done = run("load", url, "--batch-size", "4", "--no-baseline", cwd=tmp_path)
    assert done.returncode == 1  # many sizes, no resize: the flags that fix it are named
    assert "samples of different shapes" in done.stderr and "--resize N, --crop N or --ragged" in done.stderr
    done = run("load", url, "--resize", "64", "--repeat", "2", "--json", "--batch-size", "4", "--sequential-rows", "6",
               "--memory-budget", "64MiB", "--processes", "0", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert (doc["source"], doc["network"], doc["latency_emulated"], doc["rows"]) == (
        "DeepLakeSource",
        "local disk",
        False,
        12,
    )
    assert doc["machine"]["cpus"] >= 1 and doc["machine"]["load_average_1min"] >= 0  # what else ran, said
    assert doc["settings"]["augment"] == "[Resize(64)]" and doc["settings"]["memory_budget"] == str(64 << 20)
    sync, ours = doc["readers"]
    assert sync["name"] == "sequential ds[i][col] (6 rows)" and sync["samples"] == 6
    assert ours["name"].startswith("asyncload column reads") and ours["samples"] == 12
    for r in (sync, ours):
        assert r["runs"] == 2 and len(r["each"]) == 2
        lo, hi = r["epoch_samples_per_s_range"]
        assert 0 < lo <= r["epoch_samples_per_s"] <= hi  # the median of the whole-epoch figures, in their range
        # whole epoch, open included: the samples over each run's whole time
        assert all(e["epoch_samples_per_s"] == pytest.approx(e["samples"] / e["seconds"]) for e in r["each"])
        assert r["cpu_ms_per_sample"] > 0 and r["peak_rss_mb"] > 0
    assert doc["speedup_epoch"] == pytest.approx(ours["epoch_samples_per_s"] / sync["epoch_samples_per_s"])
    # asyncload's CPU by stage: processes=0 starts no reader process, the resize is decode's; the stages and
    # the report's own memory sampler add up to the whole (medians of two runs: their means)
    assert sync["cpu_ms_per_sample_by_stage"] is None
    st = ours["cpu_ms_per_sample_by_stage"]
    assert set(st) == {"reader processes", "fetch", "decode", "collate", "consumer", "memory sampler"}
    # (no reader process: what is left is other short-lived children's, 0.0002-0.05 ms a sample in the runs seen)
    assert st["reader processes"] < 0.1 * ours["cpu_ms_per_sample"] and st["decode"] > 0 and st["consumer"] > 0
    assert sum(st.values()) == pytest.approx(ours["cpu_ms_per_sample"], rel=0.05)


def test_train_counts_the_classes_in_the_data_and_names_a_count_that_is_too_small(photos: Path, tmp_path: Path) -> None:
    url = to_deeplake(photos, f"file://{tmp_path / 'seg'}")  # no class_names metadata
    common = ["--data", url, "--epochs", "1", "--image-size", "32", "--batch-size", "4", "--checkpoint", "null",
              "--set", "model_only_steps=0", "--set", "progress=false", "--set", "max_steps_per_epoch=1"]  # fmt: skip
    done = run("train", *common, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "on 9 rows, validating on 3," in done.stdout  # --data: every row, 20% held out
    assert (
        "5 classes from the data (largest id 4 in 12 rows): class 0, class 1, class 2, class 3, class 4" in done.stdout
    )
    assert "(class 0 " in done.stdout and "class 4 " in done.stdout.split("mIoU")[1]
    done = run("train", *common, "--classes", "3", "--class-names", "a,b,c", cwd=tmp_path)
    assert done.returncode == 2
    assert "classes=3 is not allowed for this data: column 'masks' holds a class id of 3 or more" in done.stderr
    assert "the count came from the config" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.timeout(180)
def test_load_reads_files_under_an_s3_prefix_and_names_a_damaged_file_by_its_key(
    seaweed, photos: Path, tmp_path: Path
) -> None:
    bucket = seaweed.create_bucket("own-files")
    seaweed.put_tree(bucket, "files", photos)
    bad = photos.parent / "bad"
    if not bad.exists():
        import shutil

        shutil.copytree(photos, bad)
        jpg = bad / "images" / "photo_0003.jpg"
        jpg.write_bytes(jpg.read_bytes()[:-600])  # cut short: a truncated upload
    seaweed.put_tree(bucket, "bad", bad)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | seaweed.env()
    del env["AWS_ENDPOINT_URL"]  # given as --endpoint below

    done = run("load", f"s3://{bucket}/files", "--endpoint", seaweed.endpoint_url, "--resize", "64",
               "--batch-size", "4", "--sequential-rows", "4", cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "source: ObjectStoreSource (no Deep Lake dataset there" in out
    assert f"network: S3 endpoint {seaweed.endpoint_url}; asyncload load emulates no latency" in out
    assert "| sequential GETs, one row at a time (4 rows) | 4 |" in out
    assert "| asyncload row reads, concurrency auto, augment [Resize(64)] | 12 |" in out
    assert "Unclosed" not in done.stderr and "Traceback" not in done.stderr  # the baseline's session closed

    done = run("load", f"s3://{bucket}/bad", "--source", "files", "--endpoint", seaweed.endpoint_url,
               "--resize", "64", "--no-baseline", cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 1
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"asyncload load: reading column 'images' of s3://{bucket}/bad at indices [3]"), line
    assert f"s3://{bucket}/bad/images/photo_0003.jpg" in line and "Premature end of JPEG file" in line

    done = run("load", f"s3://{bucket}/files", "--source", "deeplake", "--endpoint", seaweed.endpoint_url,
               cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 1 and f"s3://{bucket}/files" in done.stderr  # forced: Deep Lake's not-found, named
