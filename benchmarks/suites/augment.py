"""Random-resized-crop training input, built into asyncload or written by hand: ``make bench-augment``.

    python benchmarks/suites/augment.py [--config configs/bench_augment.yaml] [--set key=value ...]

The WAN suite's engine (``wan.py``: the same world, fresh processes, whole cold first epoch, lock,
report) with the augmentation config: variable-size photo-like JPEGs with PNG masks at 0 and 50 ms RTT,
read into 256×256 crops (``RandomResizedCrop(256, scale=(0.25, 1), ratio=(3/4, 4/3))`` + horizontal
flip) by asyncload's built-in augmentation, by asyncload with the same augmentation as a per-sample
Pillow transform, by a map-style Dataset with that transform in ``DataLoader(num_workers=2, 4)``
(spawn), and by the hand-written reference (``peers/augment_reference.py``); then peak RSS on
2048×2048 photos on local disk, where the byte budget, not the sample count, bounds memory.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.suites.wan import main as run_suite  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return run_suite(argv, default_config="configs/bench_augment.yaml")


if __name__ == "__main__":
    sys.exit(main())
