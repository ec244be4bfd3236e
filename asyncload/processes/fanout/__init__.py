"""Fan-out over processes: K persistent worker processes, each reading 1/K of every epoch's batches with
its own ``ShardEpochs`` (event loop, CPU pool, store handle).

Why processes: one loader's loop thread and CPU pool share one GIL, so a transform written in Python (or
any per-sample work that holds the GIL) caps an epoch at one core however many reads are in flight.
Each worker process runs its own event loop, CPU pool and Deep Lake handle.

Why persistent: a spawned worker imports torch and Deep Lake and opens the store (seconds, every time);
its store handle keeps Deep Lake's chunk caches and its loader keeps the concurrency tuner's setting. So a
``WorkerPool`` starts its workers once (on the first epoch's first ``next()``) and keeps them until it is
closed; each epoch is a message (``StartEpoch``: epoch number and the batches to leave out on resume).

Why the batch sequence is unchanged: the sampler deals a shard's batches to its ``num_workers`` round-robin
(batch ``j`` to worker ``j % W``). Worker ``k`` of ``K`` serves the sub-shard ``worker = w + W * k``,
``num_workers = W * K``, which is exactly every K-th batch of the shard starting at ``k``: parent batch
``j`` is batch ``j // K`` of worker ``j % K``. Reading the workers round-robin (``in_order=True``)
therefore yields the same batches, in the same order, as one ``AsyncLoader`` with the same shard.

Lifetimes: ``WorkerPool.close()``, garbage collection of the pool, interpreter exit, a dead worker and
Ctrl-C in the consumer stop every worker (asked, then killed half a second later) and join them.
``AsyncLoader(processes=K)`` owns one pool and reads each epoch from it with ``FanoutIterator(pool, epoch)``.
An epoch abandoned mid-way is settled before the pool serves another, and none of its batches reaches the
next.

Failures: an exception in a worker is re-raised in the parent (at its place in the order when
``in_order``) and the workers stay usable. A worker that dies, or stops answering (stuck in a read of a
silent store), is replaced and what it owed is read again, as ``asyncload.processes.recovery`` decides for the Deep
Lake reader process too: deaths within ``max_restarts``, one outage within ``stall_timeout``; past those,
``WorkerError`` or ``StallError`` naming it and the dataset indices it had not delivered, and the pool is
closed.

Modules, one concept each; each imports only those above it:
- ``shares``: which batches worker ``k`` serves (``sub_shard``), with which options;
- ``wire``: the messages between parent and worker, and how they travel (fds, shared memory);
- ``worker``: what runs inside a worker process;
- ``pool``: the parent's hold on the processes (``WorkerPool``): start, ask for an epoch, settle one left
  open, stop;
- ``iterator``: one epoch read from the workers (``FanoutIterator``).
"""

from __future__ import annotations

from .iterator import FanoutIterator
from .pool import WorkerPool
from .shares import sub_shard

__all__ = ["FanoutIterator", "WorkerPool", "sub_shard"]
