"""Which objects make up row ``i`` of an object-store dataset: ``<column>/<stem>.<ext>`` paired by stem.

Why here, apart from the requests: the pairing rules (a manifest's order, or sorted stems of a listing
with lone objects skipped) are plain data work, the same whichever store the keys came from.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence

from ..errors import SourceError

#: A manifest as a user passes it: a URL or local path of a manifest file, or its rows.
Manifest = str | os.PathLike[str] | Sequence[str | Mapping[str, str]]
#: A manifest row: a stem (one key per column, with the column's suffix) or ``{column: key}``.
Row = str | dict[str, str]
#: For each column, the key (relative to the source's prefix) of every row.
Keys = dict[str, tuple[str, ...]]

log = logging.getLogger("asyncload")


def split_stem(rel: str) -> str:
    """``a/b/000123.png`` → ``a/b/000123`` (the last extension only)."""
    head, _, name = rel.rpartition("/")
    stem = name.rsplit(".", 1)[0] if "." in name.lstrip(".") else name
    return f"{head}/{stem}" if head else stem


def parse_manifest(data: bytes, where: str) -> list[Row]:
    """A manifest's rows: a JSON list (of stems, or of ``{column: key}``), ``{"stems": [...]}``, or text
    with one stem per line (blank lines and ``#`` comments skipped)."""
    text = data.decode("utf-8-sig")
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        try:
            doc = json.loads(text)
        except ValueError as exc:
            raise SourceError(f"manifest {where} is not valid JSON: {exc}") from None
        if isinstance(doc, dict):
            doc = doc.get("stems", doc.get("samples"))
        if not isinstance(doc, list):
            raise SourceError(f"manifest {where}: expected a JSON list of stems or {{'stems': [...]}}")
        return [r if isinstance(r, dict) else str(r) for r in doc]
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def read_local(path: str) -> bytes:
    """A manifest file's bytes (blocking: run it off the loop)."""
    with open(path, "rb") as f:
        return f.read()


def keys_from_manifest(
    rows: Sequence[str | Mapping[str, str]], columns: Sequence[str], suffixes: Mapping[str, str], where: str
) -> Keys:
    """Row ``i`` is ``rows[i]``: ``<column>/<stem><suffix>`` for a stem, the named key for a mapping."""
    keys: dict[str, list[str]] = {c: [] for c in columns}
    for i, row in enumerate(rows):
        for col in columns:
            if isinstance(row, Mapping):
                if col not in row:
                    raise SourceError(f"manifest of {where}: row {i} has no key for column {col!r}")
                keys[col].append(str(row[col]).lstrip("/"))
            else:
                keys[col].append(f"{col}/{row}{suffixes[col]}")
    return {c: tuple(v) for c, v in keys.items()}


def stems(column: str, rels: Sequence[str], where: str) -> dict[str, str]:
    """Stem → key of the objects a listing found under ``<column>/`` (keys relative to the prefix, the
    column included; folder markers skipped). Two objects with one stem are an error."""
    found: dict[str, str] = {}
    for rel in rels:
        if rel.endswith("/"):
            continue  # a folder marker
        stem = split_stem(rel[len(column) + 1 :])
        if stem in found:
            raise SourceError(
                f"{where}: two {column!r} objects share the stem {stem!r} ({found[stem]}, {rel}); "
                "keep one, or pass a manifest naming the keys"
            )
        found[stem] = rel
    return found


def keys_from_listing(by_column: Mapping[str, Mapping[str, str]], where: str) -> Keys:
    """Rows from a listing (``by_column[column]`` from :func:`stems`): objects pair across columns by stem,
    rows in sorted stem order; a stem missing from any column is skipped with a warning."""
    common = set.intersection(*(set(s) for s in by_column.values()))
    for col, found in by_column.items():
        lone = sorted(set(found) - common)
        if lone:
            log.warning(
                "asyncload: %s: %d %r objects have no partner in every other column and are skipped (first: %s)",
                where, len(lone), col, found[lone[0]],
            )  # fmt: skip
    order = sorted(common)
    return {col: tuple(found[s] for s in order) for col, found in by_column.items()}


__all__ = [
    "Keys",
    "Manifest",
    "Row",
    "keys_from_listing",
    "keys_from_manifest",
    "parse_manifest",
    "read_local",
    "split_stem",
    "stems",
]
