"""What producers hand consumers, in one place: who sends what, and what it means.

The loop thread puts ``Ready``, ``Failure`` and ``END`` on an epoch's ready queue and
``epoch.EpochIterator`` takes them off; the pin thread hands ``DeviceFeed`` the same ``Failure`` and
``END``; a fan-out worker sends its epoch's error to the parent as a ``Failure`` too (the fan-out's own
messages are in ``fanout.wire``). A named sentinel prints as its name in a debugger or a log, where an
``object()`` prints as an address.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import pack, unpack


class Sentinel:
    """A unique marker with a readable name."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


#: The epoch ended: every batch of the plan was delivered (or the pipeline was told to stop).
END = Sentinel("END")
#: ``close()`` was called while the epoch was being read: the consumer raises ``LoaderClosedError``, never
#: ``StopIteration`` (which only ever means that every batch of the epoch was delivered).
CLOSED = Sentinel("CLOSED")
#: Every sample of a batch was skipped (``on_error="skip"``): the consumer records the batch as taken.
EMPTY = Sentinel("EMPTY")


class Ready(NamedTuple):
    """A batch for the consumer: its number in the shard's plan, its sample count, the batch (or EMPTY)."""

    seq: int
    count: int
    batch: Any


class Failure:
    """An exception on its way to the consumer that raises it, at the failed batch's place in the order:
    from the loop thread, the pin thread or another process. The one error carrier: within a process it
    is the exception object itself; pickled, it travels as data (``errors.pack``), so an exception that
    the receiver cannot rebuild still arrives, as a ``RemoteError`` with its type name and text, instead
    of breaking the channel. ``raise_in(where)`` gives the exception to raise, with a note naming where
    it was raised and its traceback there when it came from another process."""

    __slots__ = ("exc", "remote_traceback")

    def __init__(self, exc: BaseException, remote_traceback: str | None = None) -> None:
        self.exc = exc
        self.remote_traceback = remote_traceback

    def __reduce__(self) -> tuple[Any, ...]:
        return _arrived, pack(self.exc)

    def raise_in(self, where: str) -> BaseException:
        """The exception to raise; one that came from another process notes ``where`` and its traceback."""
        exc = self.exc
        if self.remote_traceback is not None:
            exc.add_note(f"asyncload: raised in {where}; its traceback there:\n{self.remote_traceback.rstrip()}")
        return exc


def _arrived(pickled: bytes, type_name: str, message: str, tb: str) -> Failure:
    return Failure(unpack(pickled, type_name, message), tb)


__all__ = ["CLOSED", "EMPTY", "END", "Failure", "Ready", "Sentinel"]
