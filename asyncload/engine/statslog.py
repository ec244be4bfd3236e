"""``StatsLogger``: a loader's figures, where the time goes and ``waiting_on``, as TensorBoard scalars.

Why a helper and not a loader setting: the figures are read from the consumer's side (``stats()`` of an
``AsyncLoader``, a ``DeviceFeed``, or the ``AsyncIterableDataset`` behind a DataLoader), every N batches,
by whatever iterates them; a setting would have to travel to fan-out and DataLoader workers. The writer
is duck-typed (anything with ``add_scalar(tag, value, step)``, e.g. ``torch.utils.tensorboard``'s
``SummaryWriter``): nothing is imported for it, so TensorBoard need not be installed. The Lightning
callback (``asyncload.lightning``) logs the same ``scalars`` through the trainer's logger.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from ..errors import ConfigError
from .stats import STAGES

#: The ``stats()`` keys logged (those present and numeric), as ``<prefix>/<key>``.
LOGGED = (
    "samples_per_s", "consumer_wait_frac", "steady_wait_s", "step_s", "cpu_busy_frac", "open_s", "read_s",
    "decode_s", "augment_s", "transform_s", "collate_s", "queue_s", "copy_s", "node_hit_rate",
    *(f"wait_on_{k}_s" for k in (*STAGES, "other")),
)  # fmt: skip
#: What ``waiting_on`` may say: each is logged as ``<prefix>/waiting_on/<name>``, 1.0 for the verdict, else 0.0.
VERDICTS = ("training", *STAGES, "copy", "start")


def scalars(stats: Mapping[str, Any], prefix: str = "asyncload") -> dict[str, float]:
    """The numbers of ``stats`` worth a chart, by tag: ``LOGGED`` and the verdict as one-hot ``VERDICTS``."""
    out = {
        f"{prefix}/{k}": float(v)
        for k in LOGGED
        if isinstance(v := stats.get(k), (int, float)) and not isinstance(v, bool)
    }
    verdict = stats.get("waiting_on")
    if verdict is not None:
        out.update({f"{prefix}/waiting_on/{name}": float(name == verdict) for name in VERDICTS})
    return out


class StatsLogger:
    """Write a loader's ``stats()`` to ``writer`` every ``every_n_batches`` batches.

    ``writer``: anything with ``add_scalar(tag, value, step)`` (a TensorBoard ``SummaryWriter``).
    ``watch(batches)`` yields the batches of an ``AsyncLoader`` or ``DeviceFeed`` and logs their
    ``stats()``; for a DataLoader over an ``AsyncIterableDataset`` pass ``stats=dataset.stats``::

        log = StatsLogger(SummaryWriter("runs/a"), every_n_batches=50)
        for batch in log.watch(loader):
            ...

    The step of each point is the count of batches watched (``log(stats, step)`` to choose it yourself).
    """

    def __init__(self, writer: Any, every_n_batches: int = 100, prefix: str = "asyncload") -> None:
        if not callable(getattr(writer, "add_scalar", None)):
            raise ConfigError(
                f"writer={writer!r} is not allowed: an object with add_scalar(tag, value, step), such as "
                "torch.utils.tensorboard.SummaryWriter"
            )
        if not isinstance(every_n_batches, int) or isinstance(every_n_batches, bool) or every_n_batches < 1:
            raise ConfigError(f"every_n_batches={every_n_batches!r} is not allowed: an int >= 1")
        self.writer = writer
        self.every_n_batches = every_n_batches
        self.prefix = prefix
        self.batches = 0

    def log(self, stats: Mapping[str, Any], step: int) -> None:
        """Write ``stats``'s ``scalars`` at ``step``."""
        for tag, value in scalars(stats, self.prefix).items():
            self.writer.add_scalar(tag, value, step)

    def watch(self, batches: Iterable[Any], stats: Callable[[], Mapping[str, Any]] | None = None) -> Iterator[Any]:
        """Yield ``batches``, logging ``stats()`` (default: ``batches.stats``) every ``every_n_batches`` and
        once more at the end."""
        figures = stats if stats is not None else getattr(batches, "stats", None)
        if not callable(figures):
            raise ConfigError(
                f"StatsLogger.watch({type(batches).__name__}) needs stats=: the batches have no stats() (pass "
                "stats=dataset.stats for a DataLoader over an AsyncIterableDataset)"
            )
        for batch in batches:
            yield batch
            self.batches += 1
            if self.batches % self.every_n_batches == 0:
                self.log(figures(), self.batches)
        if self.batches % self.every_n_batches:
            self.log(figures(), self.batches)


__all__ = ["LOGGED", "VERDICTS", "StatsLogger", "scalars"]
