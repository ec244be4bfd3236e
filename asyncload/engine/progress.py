"""Where an epoch stands: which of a shard's batches the consumer has taken, for exact resume.

Only batches the *consumer* took count. Batches read ahead (in flight, being assembled, waiting in the
reorder buffer or the ready queue) are not in the state, so a resumed run reads them again: nothing is
lost and nothing is yielded twice.

Batches are named by their sequence number in the shard's plan for the epoch (``EpochSampler.batches``).
In order, the consumed set is a prefix (``next``); out of order, a prefix plus a few later ones
(``extra``), which keeps the state small either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

STATE_VERSION = 2  # 2: the plan names the dataset's version


@dataclass
class EpochProgress:
    """The consumed batches of one epoch of one shard."""

    epoch: int
    total: int
    next: int = 0
    extra: set[int] = field(default_factory=set)

    def mark(self, seq: int) -> None:
        """Record that the consumer took batch ``seq``."""
        self.extra.add(seq)
        while self.next in self.extra:
            self.extra.discard(self.next)
            self.next += 1

    def done(self, seq: int) -> bool:
        return seq < self.next or seq in self.extra

    @property
    def finished(self) -> bool:
        return self.next >= self.total

    def copy(self) -> EpochProgress:
        return EpochProgress(self.epoch, self.total, self.next, set(self.extra))

    def to_dict(self, fingerprint: dict[str, Any]) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "total": self.total,
            "next": self.next,
            "extra": sorted(self.extra),
            "plan": fingerprint,
        }

    @classmethod
    def from_dict(
        cls, state: dict[str, Any], fingerprint: dict[str, Any], total: int, where: str = "the dataset"
    ) -> EpochProgress:
        """Validate a saved state against the loader it is loaded into; errors name the mismatch."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"state version {state.get('version') if isinstance(state, dict) else state!r} is not allowed: {STATE_VERSION}"
            )
        saved = state.get("plan", {})
        check_dataset_version(saved.get("dataset_version"), fingerprint.get("dataset_version"), where)
        for key, value in fingerprint.items():
            if saved.get(key) != value:
                raise ConfigError(
                    f"state was saved with {key}={saved.get(key)!r}, but this loader has {key}={value!r}; "
                    f"a resumed epoch must be cut the same way"
                )
        if state["total"] != total:
            raise ConfigError(f"state has {state['total']} batches in epoch {state['epoch']}, this loader {total}")
        return cls(int(state["epoch"]), total, int(state["next"]), set(map(int, state["extra"])))


def with_progress(state: dict[str, Any], progress: EpochProgress) -> dict[str, Any]:
    """``state`` (a ``to_dict``) with the consumed batches of ``progress`` when both are of one epoch:
    a consumer downstream of the loader (``DeviceFeed``) states what *it* has taken."""
    if state.get("epoch") != progress.epoch or state.get("total") != progress.total:
        return state
    return {**state, "next": progress.next, "extra": sorted(progress.extra)}


def check_dataset_version(saved: str | None, current: str | None, where: str) -> None:
    """Refuse to resume on other data: row numbers of one version name other samples in another."""
    if saved != current:
        raise ConfigError(
            f"state was saved on version {saved!r} of {where}, but it is now at version {current!r}: "
            f"resuming would read other samples under the same row numbers; open the saved version or "
            f"start the epoch afresh"
        )
