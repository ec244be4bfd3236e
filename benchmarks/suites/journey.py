"""A batch's journey through the training process: which asyncload modules it enters, on which threads.

Issue 36's measure of the layout: modules crossed per batch, and whether any module is entered twice on
one path. A small JPEG + lz4-mask Deep Lake dataset is read with the defaults (reader process, CPU
decode); after two warm-up batches, every Python call into the package is recorded, on every thread of
this process, while the next four are handed over (four, so that read-ahead cannot hide a hop). A path is a chain of modules with
repeats in a row folded: the chains of package modules on a thread's stack (the longest ones are listed);
"re-entered" marks a chain on which a module calls down and is called back up again. The module that
hosts a thread (its bootstrap and event loop: ``runtime/loop``) is the bottom of every chain on that
thread and is not counted as a hop.

    python benchmarks/suites/journey.py [--out FILE]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

import asyncload

PKG = Path(asyncload.__file__).resolve().parent
#: Modules that host a thread rather than carry the batch: a thread's bootstrap and its event loop. They are
#: the bottom of every stack on their thread and are not counted as a hop of the path they host.
HOSTS = re.compile(r"^(runtime\.loop|_loop)$")


def module_of(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(PKG)
    except ValueError:
        return None
    parts = rel.with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    calls: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    lock = threading.Lock()
    active = threading.Event()

    def prof(frame, event, arg):  # noqa: ANN001, ANN202 - the profiler's signature
        if event != "call" or not active.is_set():
            return
        mod = module_of(frame.f_code.co_filename)
        if mod is None:
            return
        stack: list[str] = []
        f = frame
        while f is not None:  # the chain of package modules on this thread's stack, outermost first
            m = module_of(f.f_code.co_filename)
            if m is not None and (not stack or stack[-1] != m):
                stack.append(m)
            f = f.f_back
        stack.reverse()
        while len(stack) > 1 and HOSTS.match(stack[0]):  # the thread's host (its bootstrap, its event loop)
            stack.pop(0)
        with lock:
            calls[threading.current_thread().name].add(tuple(stack))

    with tempfile.TemporaryDirectory() as tmp:
        url = asyncload.make_dataset(f"{tmp}/ds", 64, height=64, width=64, image_format="jpg", progress=False)
        src = asyncload.DeepLakeSource(url)
        loader = asyncload.AsyncLoader(src, batch_size=8, shuffle=False, prefetch=1, concurrency=8)
        threading.setprofile(prof)  # every thread the loader starts from here on is recorded
        sys.setprofile(prof)
        it = iter(loader)
        next(it), next(it)
        active.set()  # four batches in the steady state: whatever read-ahead did, every hop of one is seen
        batches = [next(it) for _ in range(4)]
        active.clear()
        sys.setprofile(None)
        threading.setprofile(None)
        assert all(len(b["images"]) == 8 for b in batches)
        del it, loader
    lines = []
    every: set[str] = set()
    for thread, stacks in sorted(calls.items()):
        paths = sorted(p for p in stacks if not any(q != p and q[: len(p)] == p for q in stacks))
        lines.append(f"- {thread}:")
        for path in paths:
            again = sorted({m for i, m in enumerate(path) if m in path[:i]})
            every |= set(path)
            lines.append(f"  - {' → '.join(path)}" + (f"  (re-entered: {', '.join(again)})" if again else ""))
    lines.insert(
        0, f"{len(every)} modules entered in the training process in the steady state: {', '.join(sorted(every))}"
    )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
