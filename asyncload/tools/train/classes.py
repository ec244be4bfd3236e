"""How many classes a segmentation dataset has, and what they are called.

Why a module: the model's head, the loss and the per-class IoU all need the count, and a wrong count
fails far from its cause (``IndexError: Target 4 is out of bounds`` at the first step). So it is settled
once, before the model is built, in this order:

1. ``classes`` and ``class_names`` from the config, when given;
2. the mask column's ``metadata["class_names"]`` (Deep Lake's ``ClassLabel`` convention), or the
   dataset's ``metadata["classes"]`` (what ``asyncload.tools.synthetic`` wrote before it wrote the former);
3. else the data: the largest class id in the mask column over the rows used, + 1, read through
   asyncload itself (only the mask column, stored bytes decoded on the CPU pool).

A class id in the data at or above the count then stops the job with a ``ConfigError`` naming the
count and where it came from (``job``), not with the loss's ``IndexError``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import ConfigError
from ...sources.deeplake import DeepLakeSource


@dataclass(frozen=True)
class Classes:
    """The classes a job trains: their names (one per class id) and where the count came from."""

    names: tuple[str, ...]
    origin: str  # "the config", "metadata of column 'masks'", "the data (largest id 4 in 600 rows)"

    def __len__(self) -> int:
        return len(self.names)


def metadata_names(source: DeepLakeSource, column: str) -> tuple[str, ...] | None:
    """The column's ``class_names`` metadata, else the dataset's ``classes``; None when neither is set."""
    ds = source.dataset()
    for meta, key in ((ds[column].metadata, "class_names"), (ds.metadata, "classes")):
        names = meta[key] if key in meta.keys() else None
        if isinstance(names, (list, tuple)) and len(names) >= 2:
            return tuple(str(n) for n in names)
    return None


def largest_id(source: DeepLakeSource, rows: int, batch_size: int = 64) -> int:
    """The largest value in ``source``'s one (mask) column over its first ``rows`` rows, read with
    ``AsyncLoader`` (ragged: masks of any size)."""
    from ...loader import AsyncLoader
    from ...sources.subset import RangeSource

    (column,) = source.columns
    top = 0
    with AsyncLoader(RangeSource(source, 0, rows), batch_size, ragged="list", with_index=False) as loader:
        for batch in loader:
            masks = batch[column]
            top = max([top] + [int(m.max()) for m in masks if m.numel()])
    return top


def resolve_classes(source: DeepLakeSource, rows: int, classes: int | None, names: tuple[str, ...] | None) -> Classes:
    """The classes to train (see the module docstring). ``source``: the dataset's mask column alone,
    with its credentials; ``rows``: the rows the job uses."""
    (column,) = source.columns
    if names is not None and classes is not None and len(names) != classes:
        raise ConfigError(f"class_names={list(names)!r} is not allowed: a list of {classes} names (classes: {classes})")
    if classes is None and names is not None:
        return Classes(tuple(names), "the config")
    meta = metadata_names(source, column) if names is None else None
    if classes is not None:
        if names is None and meta is not None and len(meta) == classes:
            return Classes(meta, f"the config, names from the metadata of column {column!r}")
        return Classes(names or tuple(f"class {i}" for i in range(classes)), "the config")
    if meta is not None:
        return Classes(meta, f"metadata of column {column!r}")
    top = largest_id(source, rows)
    if top < 1:
        raise ConfigError(
            f"classes=None is not allowed here: column {column!r} holds only class 0 in its {rows} rows; "
            "set classes (--classes N)"
        )
    return Classes(tuple(f"class {i}" for i in range(top + 1)), f"the data (largest id {top} in {rows} rows)")


def describe(c: Classes) -> str:
    return f"{len(c)} classes from {c.origin}: {', '.join(c.names)}"


__all__ = ["Classes", "describe", "largest_id", "metadata_names", "resolve_classes"]
