"""The guide's "Train on your own photos" (docs/guides/own-data.md), run as written: a folder of JPEGs
and PNG masks (5 classes, every photo its own size) → the section's Python script → a Deep Lake dataset
on a real SeaweedFS S3 server → the section's ``asyncload load`` and ``asyncload train`` commands,
through the installed ``asyncload`` command. Only the bucket's address and credentials come from the
test (the standard ``AWS_*`` variables the section exports); every line run is the guide's, and the
train command gets one setting more, ``--set model_only_steps=0`` (the model-alone figure, 13 steps more
than the two epochs' own on 16 photos).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from .user_photos import CLASS_NAMES, photo_folder

ROOT = Path(__file__).resolve().parents[1]
ASYNCLOAD = str(Path(sys.executable).with_name("asyncload"))  # the installed console script


def recipe() -> tuple[str, list[str]]:
    """The section's Python script and its ``asyncload`` command lines."""
    text = (ROOT / "docs" / "guides" / "own-data.md").read_text()
    section = text[text.index("## Train on your own photos") :]
    end = section.find("\n## ", 5)  # this section only; it may be the page's last
    section = section if end < 0 else section[:end]
    (script,) = re.findall(r"```python\n(.*?)```", section, re.S)
    commands = [ln for block in re.findall(r"```bash\n(.*?)```", section, re.S) for ln in block.splitlines()]
    return script, [ln.split("#")[0].strip() for ln in commands if ln.startswith("asyncload ")]


@pytest.mark.timeout(240)
def test_the_own_data_recipe_runs_as_written_on_a_real_s3_server(seaweed, tmp_path: Path) -> None:
    script, commands = recipe()
    assert [c.split()[:2] for c in commands] == [["asyncload", "load"], ["asyncload", "train"]]
    photo_folder(tmp_path / "photos", 16, sizes=(160, 420))
    seaweed.create_bucket("my-bucket")  # the section's bucket name, on the test's server
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | seaweed.env()
    (tmp_path / "folder_to_deeplake.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "folder_to_deeplake.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "16 rows at s3://my-bucket/photos-seg" in done.stdout

    load, train = (
        subprocess.run(
            [ASYNCLOAD, *cmd.split()[1:], *(["--set", "model_only_steps=0"] if " train " in cmd else [])],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        for cmd in commands
    )
    assert load.returncode == 0, load.stderr
    assert "source: DeepLakeSource (a Deep Lake dataset is there)" in load.stdout
    assert f"network: S3 endpoint {seaweed.endpoint_url}; asyncload load emulates no latency" in load.stdout
    assert "median of 3 run(s)" in load.stdout
    assert re.search(r"\| sequential ds\[i\]\[col\] \(16 rows\) \| 16 \| [\d,]+ \|", load.stdout), load.stdout
    assert re.search(r"\| asyncload column reads, concurrency auto, augment \[Resize\(256\)\] \| 16 \|", load.stdout)

    assert train.returncode == 0, train.stderr
    names = ", ".join(CLASS_NAMES)
    assert f"5 classes from metadata of column 'masks': {names}" in train.stdout, train.stdout
    epochs = [ln for ln in train.stdout.splitlines() if ln.startswith("epoch ")]
    assert len(epochs) == 2 and all(
        re.search(r"mIoU [\d.]+ \(" + ", ".join(rf"{n} [\d.na]+" for n in CLASS_NAMES) + r"\)", ln) for ln in epochs
    ), epochs
