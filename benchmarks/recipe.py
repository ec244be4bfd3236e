"""The published "Async Data Loader" recipe (shared/seeds/004), bounded to stop after N samples.

Kept as published in every way that matters to its speed and its defects: a module-level index behind a
lock that wraps with ``% (total_count - 1)`` (the last row is never read), 128 coroutines that each
``gather`` one row's image and mask with ``get_async`` and ``put_nowait`` onto a multiprocessing Queue,
the loop on a daemon thread, and a consumer that busy-waits on ``q.empty()``. The one change: ``__iter__``
stops after ``limit`` samples, so it can be timed. Its threads are never stopped, so run it in a process
of its own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from multiprocessing import Queue
from typing import Any

import torch.utils.data

_lock = threading.Lock()
_index = -1


def _rows(ds: Any) -> Iterator[Any]:
    global _index
    total = len(ds)
    while True:
        with _lock:
            _index = (_index + 1) % (total - 1)
            i = _index
        yield ds[i]


class RecipeAsyncDataset(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    def __init__(self, ds: Any, limit: int, tasks: int = 128) -> None:
        self.ds, self.limit, self.tasks = ds, limit, tasks
        self.started = False
        self.rows = _rows(ds)
        self.q: Any = Queue()

    async def _run(self) -> None:
        for row in self.rows:
            pair = await asyncio.gather(row.get_async("images"), row.get_async("masks"))
            self.q.put_nowait(pair)

    def _start(self) -> None:
        loop = asyncio.new_event_loop()
        for _ in range(self.tasks):
            loop.create_task(self._run())

        def forever() -> None:
            asyncio.set_event_loop(loop)
            loop.run_forever()

        threading.Thread(target=forever, daemon=True).start()
        self.started = True

    def __iter__(self) -> Iterator[Any]:
        for _ in range(self.limit):
            if not self.started:
                self._start()
            while self.q.empty():
                pass
            image, mask = self.q.get()
            yield image, mask


def main() -> None:
    """``recipe.py URL MAX_SAMPLES MAX_SECONDS BATCH``: measure through DataLoader, print JSON, exit hard
    (the recipe's 128 coroutines never stop, so a normal interpreter exit would wait on nothing useful)."""
    import json
    import os
    import sys

    import deeplake
    from torch.utils.data import DataLoader

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from asyncload.measure import measure

    url, limit, seconds, batch = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    creds = json.loads(os.environ.get("ASYNCLOAD_BENCH_CREDS", "null"))
    ds = deeplake.open_read_only(url, creds=creds) if creds else deeplake.open_read_only(url)
    dl = DataLoader(RecipeAsyncDataset(ds, limit), batch_size=batch, num_workers=0)
    m = measure("published recipe", dl, count=lambda b: len(b[0]), max_samples=limit, max_seconds=seconds)
    print(json.dumps(m.as_dict()), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
