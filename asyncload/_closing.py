"""``Closing``: the one lifetime contract of everything in asyncload that owns threads or processes.

Such an object is closed explicitly (``close()``), by a ``with`` block, or when it is garbage-collected
(``break`` out of a ``for`` loop drops the iterator). ``close()`` must be idempotent; a finaliser never
raises.
"""

from __future__ import annotations

from typing import Any


class Closing:
    """Mixin: ``with`` and garbage collection both call ``close()``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass
