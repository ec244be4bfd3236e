"""Data-parallel training of a segmentation model on 8 GPUs, fed by asyncload: the complete script.

    torchrun --nproc-per-node 8 examples/train_ddp.py --data s3://bucket/seg           # one node, 8 GPUs
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/train_ddp.py --data s3://bucket/seg                                   # two nodes
    torchrun --nproc-per-node 2 examples/train_ddp.py --data data/seg --epochs 1       # CPU, gloo: a try-out

Run it again and it resumes from ``--checkpoint`` (on a disk every node sees): mid-epoch where it stopped
(``--max-steps`` ends a time-limited job with a checkpoint), or at the next epoch.

What asyncload does here, and what it asks of the script:

- **Each rank reads its own share.** ``AsyncLoader`` takes the rank and the world size from the initialised
  process group: no ``DistributedSampler``. Every row comes once per epoch across the ranks; when the
  ranks do not divide the dataset, the last rank's batch is padded (``remainder="pad"``) so that every rank
  runs the same number of steps and no collective hangs.
- **``set_epoch(epoch)``** every epoch, on every rank: the same seeded order everywhere, a new one each epoch.
- **Batches on the GPU ahead of the step**: ``DeviceFeed`` pins and copies them on a side stream.
- **A checkpoint resumes mid-epoch exactly**: rank 0 saves ``feed.state_dict()`` (the batches the steps
  took, not the ones read ahead), every rank loads it; on another number of ranks too.
- **Remote data is fetched once per node**: the ranks of a node share the node block store on its local
  disk, so the second epoch reads nothing from the store.

Credentials for ``s3://`` come from the standard ``AWS_*`` variables (``AWS_ENDPOINT_URL`` for a store that
is not AWS); ``gs://`` and ``az://`` from their clouds' chains (``pip install "torch-asyncload[s3,gcs,azure]"``).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from asyncload import AsyncLoader, DeepLakeSource, DeviceFeed, RandomHorizontalFlip, RandomResizedCrop


def model_for(classes: int) -> torch.nn.Module:
    """Stands in for your segmentation model (a U-Net, a DeepLabV3...)."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
        torch.nn.Conv2d(32, classes, 1),
    )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a Deep Lake dataset: a path, s3://, gs://, az://")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--crop", type=int, default=256)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--checkpoint", default="checkpoint.pt")
    p.add_argument("--save-every", type=int, default=500, help="steps between checkpoints")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many steps, checkpointed (a time-limited job)")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR...
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    loader = AsyncLoader(
        DeepLakeSource(args.data, columns=("images", "masks")),
        batch_size=args.batch_size, shuffle=True, seed=0,          # rank and world size: from the process group
        augment=[RandomResizedCrop(args.crop, scale=(0.25, 1.0)), RandomHorizontalFlip()],
        normalize=((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)), layout="NCHW",
        dtype=torch.bfloat16 if cuda else None,                    # model-ready images, half the bytes to copy
    )  # fmt: skip
    model = DistributedDataParallel(model_for(args.classes).to(device), device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    start = 0
    if os.path.exists(args.checkpoint):  # every rank loads the same file (on a shared disk across nodes)
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        start = ckpt["epoch"]
        if ckpt["loader"] is not None:  # saved mid-epoch: this rank's share of what was not yet trained on
            loader.load_state_dict(ckpt["loader"])
        if rank == 0:
            print(f"resumed in epoch {start} from {args.checkpoint}", flush=True)

    steps = 0
    for epoch in range(start, args.epochs):
        loader.set_epoch(epoch)  # keeps a loaded resume point of this same epoch
        t0, waited, seen, loss, stop = time.perf_counter(), 0.0, 0, torch.zeros(()), False
        with DeviceFeed(loader, device) as feed:
            t = time.perf_counter()
            for step, batch in enumerate(feed):
                waited += time.perf_counter() - t  # the step waited on data
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                    logits = model(batch["images"])
                loss = torch.nn.functional.cross_entropy(logits.float(), batch["masks"].long())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                seen, steps = seen + len(batch["index"]), steps + 1
                stop = steps == args.max_steps  # the same step on every rank: each rank has as many batches
                if rank == 0 and (stop or (step + 1) % args.save_every == 0):
                    save(args.checkpoint, model, opt, epoch, feed.state_dict())  # exactly the batches trained on
                if stop:
                    break
                t = time.perf_counter()
        took = time.perf_counter() - t0
        figures = torch.tensor([seen, waited / took], dtype=torch.float64, device=device)
        dist.all_reduce(figures)  # samples of every rank; the ranks' fractions of time waiting, summed
        if rank == 0:
            print(
                f"epoch {epoch}: {figures[0].item():.0f} samples, loss {loss.item():.3f}, "
                f"{figures[0].item() / took:,.0f} samples/s on {world} ranks, waiting on data "
                f"{figures[1].item() / world:.0%} of the time" + (f"; stopped after {steps} steps" if stop else ""),
                flush=True,
            )
            if not stop:
                save(args.checkpoint, model, opt, epoch + 1, None)  # epoch done: a resume starts the next one
        if stop:
            break
    loader.close()
    dist.destroy_process_group()


def save(path: str, model: DistributedDataParallel, opt: torch.optim.Optimizer, epoch: int, data: dict | None) -> None:
    """Write the checkpoint whole or not at all (a job killed mid-write keeps the previous one)."""
    state = {"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "loader": data}
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
