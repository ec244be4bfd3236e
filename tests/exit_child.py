"""A training script that ends while a loader reads Deep Lake in this process (``processes=0``), for
``test_exit_status``: ``python -m tests.exit_child URL SCENARIO``. Its exit status must be its own."""

from __future__ import annotations

import sys

import torch

from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource


def main(url: str, scenario: str) -> None:
    if scenario == "dataloader":  # workers that end with the epoch, the script leaving mid-epoch
        ds = AsyncIterableDataset(DeepLakeSource(url), 8, processes=0)
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=False, timeout=60)
        for k, _ in enumerate(dl):
            if k == 3:
                break
        sys.exit(5)
    loader = AsyncLoader(DeepLakeSource(url), batch_size=8, processes=0, shuffle=True)
    it = iter(loader)
    next(it)
    if scenario == "open":  # the loader open and an epoch mid-way: the script's own status
        sys.exit(3)
    if scenario == "abandoned":  # the epoch left to the collector, in a cycle, then the script ends
        it.cycle = it  # type: ignore[attr-defined]
        del it, loader
        sys.exit(4)
    if scenario == "raises":  # an error in the training step ends the script: status 1, its traceback
        raise RuntimeError("the training step failed")
    raise SystemExit(f"unknown scenario {scenario}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
