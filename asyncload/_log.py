"""The ``asyncload`` logger, and warnings said once per process.

Some conditions hold for a whole run (a decoder missing, a worker forked from a process that used Deep
Lake, a reader that cannot be started here): said at every batch they would drown the log, so each text
is said once per process.
"""

from __future__ import annotations

import logging

log = logging.getLogger("asyncload")

_said: set[str] = set()


def log_once(message: str, level: int = logging.WARNING) -> None:
    """Log ``message`` at ``level`` the first time this process asks for it."""
    if message not in _said:
        _said.add(message)
        log.log(level, message)
