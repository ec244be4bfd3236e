"""Wall-clock limits that grow with the load the machine is under.

Why: a test that asserts "within 8 s" on a quiet 2-core machine fails a correct program at load 5-27 (an
exit took 9.3 s there, and 1 s alone). A limit is a bound on the program, not on the machine: it is
multiplied by how many runnable tasks each core had over the last minute, when more than one.
"""

from __future__ import annotations

import os


def load_factor() -> float:
    """Runnable tasks per core over the last minute (``getloadavg``), at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1.0, os.getloadavg()[0] / cores)


def within(seconds: float) -> float:
    """``seconds`` on a quiet machine, as many times longer as the machine is loaded now."""
    return seconds * load_factor()
