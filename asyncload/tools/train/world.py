"""Where the job runs: one process or a torchrun world (process group, device per rank)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...runtime.settings import check
from .config import TrainConfig


@dataclass
class World:
    rank: int
    world: int
    device: torch.device
    owns_group: bool

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum over ranks (float64, so counts stay exact)."""
        t = torch.tensor(list(values), dtype=torch.float64)
        if self.world > 1:
            t = t.to(self.device) if dist.get_backend() == "nccl" else t
            dist.all_reduce(t)
        return t.cpu().tolist()


def make_world(cfg: TrainConfig) -> World:
    """Join torchrun's process group when its variables are set (gloo on CPU, nccl on CUDA)."""
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    check(
        "device", cfg.device, want == "cpu" or torch.cuda.is_available(), "'cpu' or 'auto' here: CUDA is not available"
    )
    device = torch.device(want)
    if device.type == "cuda" and device.index is not None:
        gpus = torch.cuda.device_count()
        check("device", cfg.device, device.index < gpus, f"this machine has {gpus} CUDA device(s)")
    if device.type == "cuda" and device.index is None:
        grouped = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size() if grouped else int(os.environ.get("WORLD_SIZE", 1))
        local = int(os.environ.get("LOCAL_RANK", 0)) if world > 1 else torch.cuda.current_device()
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if world > 1 else 1
        # Checked before joining the group, on every rank alike: all of them fail with this message
        # instead of one dying in CUDA ("invalid device ordinal") while the others wait for it.
        device = torch.device("cuda", cuda_index_for_rank(cfg.device, local, ranks_here, torch.cuda.device_count()))
    owns = False
    if not (dist.is_available() and dist.is_initialized()) and "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # env://: MASTER_ADDR/PORT, RANK...
        owns = True
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return World(rank, world, device, owns)


def cuda_index_for_rank(setting_: str, local_rank: int, ranks_here: int, gpus: int) -> int:
    """The GPU of a rank (its local rank), or a ``ConfigError`` naming both counts when this machine
    runs more ranks than it has GPUs (``device: cpu`` runs any number)."""
    check(
        "device", setting_, ranks_here <= gpus and 0 <= local_rank < gpus,
        f"{ranks_here} rank(s) run on this machine but it has {gpus} CUDA device(s); "
        f"start at most {gpus} per machine (torchrun --nproc_per_node={gpus}) or set device: cpu",
    )  # fmt: skip
    return local_rank
