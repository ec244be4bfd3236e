"""The slowest rank of a job, named on rank 0: every rank posts its epoch's figures, rank 0 reads them all.

Why: each step of a data-parallel job waits for its slowest rank, and ``stats()["waiting_on"]`` answers for
one process only. Rank 0's ``stats()``, its log line, ``StatsLogger`` and the Lightning callback say which
rank held the epoch back, how long its epoch took against the others', and what that rank waited on.

How: each rank ``set``\\ s a few hundred bytes of JSON in the process group's own key-value store (the
``TCPStore`` that ``init_process_group`` rendezvoused through) at its epoch's end, from the thread that
consumed the epoch. A collective there would make every rank wait for the last one to finish its epoch,
and hang for ever if one rank stops early; a ``set`` waits for nobody. Rank 0 then waits at most
``GRACE_S`` for the others' posts (ranks in step, as under DDP, post within milliseconds of each other) and
names the ranks that had not posted yet: not having finished is what the slowest rank looks like.

Which rank is slowest: where any rank's loop waited for data ``TRAINING_BOUND`` (10 %) of its time or
more, the one that waited longest (data is what holds the job back, and where); else the one whose epoch
took longest (its training step is the slower side: ``waiting_on`` "training"). Under DDP the ranks'
epochs last alike, since every step waits for every rank, so the first rule is the one that names a rank.
"""

from __future__ import annotations

import itertools
import json
import logging
from datetime import timedelta
from typing import Any

from ..runtime.log import log_once
from .stats import TRAINING_BOUND

log = logging.getLogger("asyncload")

#: How long rank 0 waits at its epoch's end for the other ranks' figures (seconds).
GRACE_S = 5.0
#: Figures a rank posts (from its ``stats()``).
POSTED = ("elapsed_s", "steady_wait_s", "consumer_wait_frac", "waiting_on", "batches_yielded", "samples_per_s")
_boards = itertools.count()  # loaders built with a process-group shard, in the order every rank builds them


class RankBoard:
    """This loader's posts in the process group's store: ``asyncload/<loader>/<epoch>/<rank>``."""

    def __init__(self, store: Any, rank: int, world: int, number: int) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.prefix = f"asyncload/ranks/{number}"

    @classmethod
    def of_process_group(cls) -> RankBoard | None:
        """The board of a loader built on every rank of the initialised process group; None without one,
        or with one rank."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(_get_default_store(), dist.get_rank(), dist.get_world_size(), next(_boards))

    def _key(self, epoch: int, rank: int) -> str:
        return f"{self.prefix}/{epoch}/{rank}"

    def post(self, epoch: int, stats: dict[str, Any]) -> None:
        """This rank's figures of ``epoch`` (a few hundred bytes)."""
        mine = {k: stats.get(k) for k in POSTED} | {"rank": self.rank}
        self.store.set(self._key(epoch, self.rank), json.dumps(mine))

    def read(self, epoch: int) -> tuple[list[dict[str, Any]], list[int]]:
        """Rank 0: the figures of ``epoch`` every rank posted within ``GRACE_S``, and the ranks that had not."""
        keys = [self._key(epoch, r) for r in range(self.world)]
        try:
            self.store.wait(keys, timedelta(seconds=GRACE_S))
        except Exception:  # noqa: BLE001 - a timeout (its type differs between stores): read what is there
            pass
        posted, missing = [], []
        for r, key in enumerate(keys):
            if self.store.check([key]):
                posted.append(json.loads(self.store.get(key)))
            else:
                missing.append(r)
        if not missing:  # every post read: the store keeps no old epochs
            for key in keys:
                self.store.delete_key(key)
        return posted, missing


def exchange(board: RankBoard, epoch: int, stats: dict[str, Any]) -> dict[str, Any] | None:
    """Post this rank's ``stats`` of ``epoch``; on rank 0, read every rank's, log the slowest and return its
    figures (``{}`` on other ranks). None where the store failed: said once, and the caller stops reporting
    (a report is never a reason to fail training)."""
    try:
        board.post(epoch, stats)
        if board.rank != 0:
            return {}
        found = slowest(*board.read(epoch))
        log.info("%s", log_line(epoch, board.world, found))
        return found
    except Exception as exc:  # noqa: BLE001 - whatever the store raised
        log_once(
            f"asyncload: the ranks' figures could not be exchanged ({type(exc).__name__}: {exc}); the slowest rank "
            "is not reported",
            key="slowest-rank",
        )
        return None


def slowest(posted: list[dict[str, Any]], missing: list[int]) -> dict[str, Any]:
    """``stats()``'s figures of the slowest rank (module doc), from the ranks' posts."""
    out: dict[str, Any] = {"ranks_reported": len(posted), "ranks_not_finished": missing}
    if missing:  # those still reading their epoch after the others' grace: the slowest among them is unknown
        out.update(slowest_rank=missing[0], slowest_rank_wait_frac=None, slowest_rank_waiting_on="unfinished")
        return out
    if not posted:
        return out
    waits = [p.get("consumer_wait_frac") or 0.0 for p in posted]
    if max(waits) >= TRAINING_BOUND:
        worst = max(posted, key=lambda p: p.get("steady_wait_s") or 0.0)
    else:
        worst = max(posted, key=lambda p: p.get("elapsed_s") or 0.0)
    out.update(
        slowest_rank=worst["rank"],
        slowest_rank_wait_frac=worst.get("consumer_wait_frac"),
        slowest_rank_waiting_on=worst.get("waiting_on"),
        slowest_rank_elapsed_s=worst.get("elapsed_s"),
        ranks_elapsed_s=[p.get("elapsed_s") for p in sorted(posted, key=lambda p: p["rank"])],
    )
    return out


def log_line(epoch: int, world: int, found: dict[str, Any]) -> str:
    """Rank 0's line about the slowest rank of ``epoch``."""
    if found.get("ranks_not_finished"):
        return (
            f"asyncload: epoch {epoch}: ranks {found['ranks_not_finished']} of {world} had not finished the epoch "
            f"{GRACE_S:.0f} s after rank 0: the slowest are among them"
        )
    if "slowest_rank" not in found:
        return f"asyncload: epoch {epoch}: no rank's figures reached rank 0"
    others = [e for r, e in enumerate(found["ranks_elapsed_s"]) if r != found["slowest_rank"] and e is not None]
    lo, hi = (f"{min(others):.1f}", f"{max(others):.1f}") if others else ("-", "-")
    span = "-" if not others else f"{lo} s" if lo == hi else f"{lo}-{hi} s"
    frac = found["slowest_rank_wait_frac"]
    waited = f"{frac:.0%}" if frac is not None else "?"
    return (
        f"asyncload: epoch {epoch}: the slowest of {world} ranks is rank {found['slowest_rank']} (its epoch "
        f"{found['slowest_rank_elapsed_s']:.1f} s, the others' {span}): waiting on "
        f"{found['slowest_rank_waiting_on']}, its loop waited for data {waited} of its time"
    )


__all__ = ["GRACE_S", "RankBoard", "exchange", "log_line", "slowest"]
