"""The ``asyncload`` logger, and warnings said once per process.

Some conditions hold for a whole run (a decoder missing, a worker forked from a process that used Deep
Lake, a reader that cannot be started here): said at every batch they would drown the log, so each text
is said once per process.
"""

from __future__ import annotations

import logging
import mmap
import zlib

log = logging.getLogger("asyncload")

#: One byte per key, in memory shared with every process forked from the one that imported asyncload
#: (an anonymous shared mapping survives fork as the same pages): what ``log_once_forked`` has said.
_forked_said = mmap.mmap(-1, 4096)

_said: set[str] = set()


def log_once(message: str, level: int = logging.WARNING, key: str | None = None) -> None:
    """Log ``message`` at ``level`` the first time this process asks for it (or for ``key``, where the
    message carries figures that change from one call to the next)."""
    key = message if key is None else key
    if key not in _said:
        _said.add(key)
        log.log(level, message)


def log_once_forked(key: str, message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` once for ``key`` across this process and every process forked from the process
    that imported asyncload: DataLoader's forked workers, which a new epoch forks anew, say it once in
    all, not once per worker per epoch (two workers starting at the same instant may both say it)."""
    slot = zlib.crc32(key.encode()) % len(_forked_said)
    if not _forked_said[slot]:
        _forked_said[slot] = 1
        log.log(level, message)
