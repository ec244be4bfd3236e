"""Wake-ups per sample, thread group by thread group: how often each thread of a loader's processes went off
the CPU over one cold epoch (``voluntary_ctxt_switches``: it waited, for work, a lock or the GIL;
``nonvoluntary``: it was preempted), beside its CPU (``schedstat``), from ``/proc`` before and after.

    .venv/bin/python benchmarks/results/cpu/wakeups.py data/bench/photos-4000-jpg [nostore]

The loader is ``AsyncLoader(DeepLakeSource(url), 32, shuffle=True, seed=0)`` with a private, empty node store
(``cache=True``, so that a local dataset is kept too; ``nostore``: ``cache=False``). Its processes are read
3 s after it is made (the reader's start is over) and again before its last batch (the epoch's threads end
with it).
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from pathlib import Path

from asyncload import AsyncLoader, DeepLakeSource
from asyncload.tools.coldstore import cold_cache_dir


def _threads(pid: int) -> dict[str, tuple[str, int, int, float]]:
    """tid -> (kernel name, voluntary switches, involuntary switches, CPU seconds)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            status = (task / "status").read_text()
            vol = int(status.split("voluntary_ctxt_switches:")[1].split()[0])
            invol = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
            cpu = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, IndexError, ValueError):
            continue
        out[task.name] = (name, vol, invol, cpu)
    return out


def main(url: str, store: bool) -> None:
    me = os.getpid()
    with cold_cache_dir() as cache:
        loader = AsyncLoader(DeepLakeSource(url), 32, shuffle=True, seed=0, cache_dir=cache, cache=store)
        time.sleep(3)
        pids = [me, *(int(p) for p in Path(f"/proc/{me}/task/{me}/children").read_text().split())]
        before = {p: _threads(p) for p in pids}
        after: dict[int, dict[str, tuple[str, int, int, float]]] = {}
        names: dict[str, str] = {}
        n, last = 0, len(loader) - 2
        for k, batch in enumerate(loader):
            n += len(batch["index"])
            if k == last:
                after = {p: _threads(p) for p in pids}
                names = {str(t.native_id): t.name for t in threading.enumerate()}
        loader.close()
    for p in pids:
        groups: dict[str, list[float]] = {}
        for tid, (name, vol, invol, cpu) in after[p].items():
            v0, i0, c0 = before[p].get(tid, (name, 0, 0, 0.0))[1:]
            group = re.sub(r"[-_]?\d+$", "", names.get(tid, name) if p == me else name) or name
            g = groups.setdefault(group, [0, 0, 0.0])
            g[0] += vol - v0
            g[1] += invol - i0
            g[2] += cpu - c0
        print("training process" if p == me else f"child {p}")
        for group, (vol, invol, cpu) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
            if vol + invol >= 50:
                print(f"  {group:28s} voluntary {vol / n:5.2f}  involuntary {invol / n:5.2f}  CPU {1e3 * cpu / n:.3f} ms"
                      " a sample")  # fmt: skip
    print(f"{n} samples")


if __name__ == "__main__":
    main(sys.argv[1], store=not (len(sys.argv) > 2 and sys.argv[2] == "nostore"))
