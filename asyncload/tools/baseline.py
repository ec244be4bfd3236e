"""``asyncload load``'s synchronous baseline: the loop a training script writes without asyncload, doing the
same work per sample that the loader does.

Why the same work: a baseline that decodes but does not resize, crop or normalize does less per sample
than asyncload with ``--resize 128`` or ``--crop 224``, and the ratio then compares different work (a
run read 0.13x for that reason alone). So each row is read one after another (the round trips in
sequence), each image and mask decoded (by Deep Lake for ``ds[i][col]``, by the source for files), and
then shaped as the loader's ``augment=`` would shape it: the same draw of crop box and flip per
(seed, epoch, row) (``Augment.draws``), the same OpenCV crop, resize and flip (``decode.apply``), and
``normalize=`` as float arithmetic on the image. The loader's own advantages stay its own: it decodes a
JPEG at a reduced scale where a crop shrinks it, on a pool of threads, with reads in flight meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np


class Shaper:
    """The per-sample work of the loader's ``augment=`` and ``normalize=`` settings, done one sample at a
    time on this thread; ``roles``: column -> "image" or "mask" (columns not named are left as read)."""

    def __init__(self, settings: Mapping[str, Any], roles: Mapping[str, str]) -> None:
        from ..image.augment import Augment

        ops = settings.get("augment")
        self.augment = Augment(ops) if ops else None
        self.normalize = settings.get("normalize")
        self.seed = int(settings.get("seed", 0))
        self.roles = dict(roles)

    @property
    def work(self) -> str:
        """What the baseline does to each sample, for the report: ``decodes each row, then resizes and
        flips it as the loader's settings do``."""
        from ..image.augment import RandomHorizontalFlip, RandomResizedCrop, Resize

        verbs: list[str] = []
        for op in self.augment.ops if self.augment is not None else ():
            verbs += {Resize: ["resizes"], RandomResizedCrop: ["crops", "resizes"], RandomHorizontalFlip: ["flips"]}[
                type(op)
            ]
        if self.normalize is not None:
            verbs.append("normalizes")
        verbs = list(dict.fromkeys(verbs))
        if not verbs:
            return "decodes each row"
        said = verbs[0] if len(verbs) == 1 else ", ".join(verbs[:-1]) + " and " + verbs[-1]
        return f"decodes each row, then {said} it as the loader's settings do"

    def row(self, values: Mapping[str, Any], row: int, epoch: int) -> dict[str, np.ndarray]:
        """One row's decoded ``values`` (column -> array) shaped as the loader shapes its samples."""
        from ..image.decode import apply

        draw = None
        out: dict[str, np.ndarray] = {}
        for c, v in values.items():
            role = self.roles.get(c)
            a = np.asarray(v)
            if role == "mask" and a.ndim == 3 and a.shape[2] == 1:
                a = a[..., 0]
            if role is not None and self.augment is not None:
                if draw is None:  # one draw per row: image and mask alike
                    draw = self.augment.draws(self.seed, epoch, [row], [a.shape[:2]])[0]
                shaped = np.empty((*draw.out, *a.shape[2:]), a.dtype)
                fill = self.augment.fills[0 if role == "image" else 1]
                apply(np.ascontiguousarray(a), shaped, draw, role, fill, self.augment.interpolation)  # type: ignore[arg-type]
                a = shaped
            if role == "image" and self.normalize is not None:
                mean, std = (np.asarray(x, np.float32) for x in self.normalize)
                a = (a.astype(np.float32) / 255.0 - mean) / std
            out[c] = a
        return out


class SyncRun:
    """The synchronous baseline as a training loop runs it: the dataset opened once, inside the first
    epoch's timing, then each epoch read one row at a time. On Deep Lake ``ds[i][col]`` for each row and
    column, each copied to an array; on object-store files (or a mixture's rows) ``read([i])``: the row's
    GETs and decodes, each row finished before the next is asked for. Each row is then shaped as the
    loader's settings shape it (``Shaper``)."""

    def __init__(
        self, where: Any, columns: Sequence[str], limit: int, settings: Mapping[str, Any] | None = None
    ) -> None:
        self.where, self.columns, self.limit = where, tuple(columns), limit
        self.settings = dict(settings or {})
        self.source: Any = None
        self.ds: Any = None
        self.ids: list[int] = []
        self.loop: asyncio.AbstractEventLoop | None = None
        self.shaper: Shaper | None = None

    def _open(self) -> None:
        self.source = self.where.make()
        if self.where.kind == "deeplake":
            self.ds = self.source.handle()  # one open: its version and creds, the rows of its query
            self.ids = self.source.row_ids(list(range(min(self.limit, len(self.source)))))
        else:
            self.loop = asyncio.new_event_loop()
            self.source.open()
            self.ids = list(range(min(self.limit, len(self.source))))
        self.shaper = Shaper(self.settings, roles_of(self.source))

    def epoch(self, e: int = 0) -> Iterator[int]:
        """One epoch (the first opens the dataset: this is a generator, so inside the timing)."""
        if self.source is None:
            self._open()
        assert self.shaper is not None
        for i in self.ids:
            if self.ds is not None:
                row = self.ds[i]
                values = {c: np.array(row[c]) for c in self.columns}
            else:
                assert self.loop is not None
                got = self.loop.run_until_complete(self.source.read([i]))
                values = {c: v[0] for c, v in got.items()}
            self.shaper.row(values, i, e)
            yield 1

    def close(self) -> None:
        if self.source is None:
            return
        self.source.close()  # files: asks this loop to close the source's session: let it
        if self.loop is not None:
            left = asyncio.all_tasks(self.loop)
            if left:  # (gather of nothing makes its future on another loop: a mixture of Deep Lake leaves none)
                self.loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            self.loop.close()
        self.source = self.ds = self.loop = None


def roles_of(source: Any) -> dict[str, str]:
    """Column -> "image" or "mask", as the loader's decode stage sees the source's columns (a source that
    says nothing: none, and the baseline shapes nothing, as the loader's augmentation would refuse it)."""
    try:
        found = source.image_columns()
    except Exception:  # noqa: BLE001 - a source without image columns (a mixture of them says through its parts)
        return {}
    return {c: col.role for c, col in (found or {}).items()}


__all__ = ["Shaper", "SyncRun", "roles_of"]
