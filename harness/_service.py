"""``LoopService``: a loopback server that runs on a ``LoopThread`` of its own (the delay line and the
fault proxy). Starting binds the port before returning; stopping closes the server on its loop, then
joins the thread, bounded, also when closing failed."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from asyncload.runtime.loop import LoopKind, LoopThread

log = logging.getLogger("harness")


class LoopService:
    """Subclasses set ``_thread_name`` and implement ``_open()`` and ``_close(timeout)`` (coroutines);
    their ``__init__`` sets ``_thread = None``, ``_loop = None`` and ``_loop_kind``."""

    _thread_name = "asyncload-service"
    _thread: LoopThread | None
    _loop: asyncio.AbstractEventLoop | None
    _loop_kind: LoopKind

    async def _open(self) -> None:
        raise NotImplementedError

    async def _close(self, timeout: float) -> None:
        raise NotImplementedError

    def _started(self) -> bool:
        return self._thread is not None

    def start(self) -> Any:
        """Start listening on a background loop thread; returns once the port is bound."""
        if self._started():
            raise RuntimeError(f"{type(self).__name__} already started")
        self._thread = LoopThread(self._thread_name, loop=self._loop_kind, cpu_workers=1)
        self._thread.start()
        try:
            self._thread.submit(self._open()).result(timeout=10)
        except BaseException:
            self._thread.stop()
            self._thread = None
            raise
        return self

    def stop(self, timeout: float = 5.0) -> bool:
        """Close the listener and every connection, then join the thread; True when all ended in time."""
        thread, self._thread = self._thread, None
        if thread is None:
            return True
        try:
            thread.submit(self._close(timeout / 2)).result(timeout)
        except Exception as exc:  # noqa: BLE001 - stopping must still join the thread
            log.warning("%s: close failed: %r", self._thread_name, exc)
        ok = thread.stop(timeout)
        self._loop = None
        return ok

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
