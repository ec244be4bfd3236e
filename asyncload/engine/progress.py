"""Where an epoch stands: which of a shard's batches the consumer has taken, for exact resume.

Only batches the *consumer* took count. Batches read ahead (in flight, being assembled, waiting in the
reorder buffer or the ready queue) are not in the state, so a resumed run reads them again: nothing is
lost and nothing is yielded twice.

Batches are named by their sequence number in the shard's plan for the epoch (``EpochSampler.batches``).
In order, the consumed set is a prefix (``next``); out of order, a prefix plus a few later ones
(``extra``), which keeps the state small either way.

A saved state has two parts besides: ``plan``, what fixes the epoch's global order (length, seed, shuffle,
and the data: its URL, identity and version, ``DATASET_KEYS``), which must match to resume at all; and
``cut``, how the saver's world cut that order (world size, batch size, the positions an earlier run had
taken), which need not: a loader cut another way (another world size, another batch size) resumes from the
positions the saver's world consumed (``engine.consumed``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

STATE_VERSION = 3  # 2: the plan names the dataset's version; 3: the cut apart, so any world resumes it
#: What a version-2 state's ``plan`` held that is the cut of the epoch, not its order.
CUT_KEYS = ("batch_size", "drop_last", "remainder", "start", "shard")
#: What names the data a state was saved on, in its ``plan`` (``dataset_of``). States saved before the URL and
#: identity were in it have ``dataset_version`` alone: they load where the version matches.
DATASET_KEYS = ("dataset_url", "dataset_identity", "dataset_version")


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

    def to_dict(self, fingerprint: dict[str, Any], cut: dict[str, Any]) -> dict[str, Any]:
        """The saved state: this progress, the epoch's order (``fingerprint``) and how it was ``cut``."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "total": self.total,
            "next": self.next,
            "extra": sorted(self.extra),
            "plan": fingerprint,
            "cut": cut,
        }

    @classmethod
    def from_dict(
        cls, state: dict[str, Any], fingerprint: dict[str, Any], where: str = "the dataset"
    ) -> tuple[EpochProgress, dict[str, Any]]:
        """The progress a saved state records and the cut it was recorded in, once its epoch's order is
        checked against the loader it is loaded into (errors name the mismatch). A version-2 state (no
        ``cut``: saved before states resumed on other world sizes) is read as the cut its plan named."""
        version = state.get("version") if isinstance(state, dict) else None
        if version not in (2, STATE_VERSION) or not isinstance(state, dict):
            raise ConfigError(
                f"state version {version if isinstance(state, dict) else state!r} is not allowed: "
                f"{STATE_VERSION} (or 2), a dict from AsyncLoader.state_dict()"
            )
        saved = dict(state.get("plan", {}))
        cut = dict(state.get("cut", {}))
        if version == 2:
            cut = {k: saved.pop(k, None) for k in CUT_KEYS} | {"taken": []}
        check_dataset(saved, fingerprint, where)
        for key, value in fingerprint.items():
            if key not in DATASET_KEYS and saved.get(key) != value:
                raise ConfigError(
                    f"state was saved with {key}={saved.get(key)!r}, but this loader has {key}={value!r}; "
                    f"a resumed epoch must have the same order"
                )
        progress = cls(int(state["epoch"]), int(state["total"]), int(state["next"]), set(map(int, state["extra"])))
        return progress, cut


def with_progress(state: dict[str, Any], progress: EpochProgress) -> dict[str, Any]:
    """``state`` (a ``to_dict``) with the consumed batches of ``progress`` when both are of one epoch:
    a consumer downstream of the loader (``DeviceFeed``) states what *it* has taken."""
    if state.get("epoch") != progress.epoch or state.get("total") != progress.total:
        return state
    return {**state, "next": progress.next, "extra": sorted(progress.extra)}


def dataset_of(source: Any) -> dict[str, Any]:
    """What names the data of ``source`` (a ``Source``) in a state: its URL, identity and version."""
    return {"dataset_url": source.url, "dataset_identity": source.identity, "dataset_version": source.version}


def check_dataset(saved: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Refuse to resume on other data (``DATASET_KEYS`` of a saved plan against ``dataset_of`` the loader's
    source): row numbers of one dataset, or one version of it, name other samples in another. A key the
    saved plan lacks (a state of the earlier format: the version alone) is not compared; the version always
    is. Custom sources without a version or identity (None) are still told apart by their URL."""
    differ = [k for k in DATASET_KEYS if (k in saved or k == "dataset_version") and saved.get(k) != current.get(k)]
    if differ == ["dataset_version"]:
        check_dataset_version(saved.get("dataset_version"), current.get("dataset_version"), where)
    elif differ:
        what = "; ".join(f"{k.removeprefix('dataset_')} {saved.get(k)!r} then, {current.get(k)!r} now" for k in differ)
        raise ConfigError(
            f"state was saved on another dataset than {where} ({what}): resuming would read other samples "
            f"under the same row numbers; load a state saved on this dataset or start the epoch afresh"
        )


def check_dataset_version(saved: str | None, current: str | None, where: str) -> None:
    """Refuse to resume on other data: row numbers of one version name other samples in another."""
    if saved != current:
        raise ConfigError(
            f"state was saved on version {saved!r} of {where}, but it is now at version {current!r}: "
            f"resuming would read other samples under the same row numbers; open the saved version or "
            f"start the epoch afresh"
        )
