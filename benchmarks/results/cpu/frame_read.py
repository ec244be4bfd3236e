"""CPU of reading one answer frame of the reader process (``isolated._read_frame``), two ways.

    nice -n 5 .venv/bin/python benchmarks/results/cpu/frame_read.py [--reps 3]

A forked writer sends frames of 32 samples (a 110 KB image and an 11 KB mask each, the size of the PNG
photos' rows) with ``_write_frame`` down a socket pair; this process reads them with the frame read of
before (the body a zeroed ``bytearray``) and of now (``numpy.empty``, left uninitialised), keeping the last 16
frames alive, as the decode stage keeps the frames it has not decoded yet (so memory is fresh, as in a run,
not the same block reused). Prints the reading process's CPU per sample.
"""

from __future__ import annotations

import argparse
import collections
import os
import pickle
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from asyncload.processes.isolated import _read_exact, _read_frame, _write_frame  # noqa: E402

ROWS, IMAGE, MASK, FRAMES, KEEP = 32, 110_000, 11_000, 96, 16


def _read_frame_zeroed(fd: int) -> Any:
    """The frame read as it was: one zeroed ``bytearray`` for the body."""
    (n,) = struct.unpack("<I", _read_exact(fd, 4))
    sizes = struct.unpack(f"<{n}Q", _read_exact(fd, 8 * n))
    body = memoryview(_read_exact(fd, sum(sizes)))
    parts, at = [], 0
    for size in sizes:
        parts.append(body[at : at + size])
        at += size
    return pickle.loads(parts[0], buffers=parts[1:])


def measure(read: Any) -> float:
    payload = {"images": [os.urandom(IMAGE) for _ in range(ROWS)], "masks": [os.urandom(MASK) for _ in range(ROWS)]}
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        b.close()
        for i in range(FRAMES):
            _write_frame(a.fileno(), ("done", i, payload, (0, 0)))
        os._exit(0)
    a.close()
    keep: collections.deque[Any] = collections.deque(maxlen=KEEP)
    c0 = time.process_time()
    for _ in range(FRAMES):
        msg = read(b.fileno())
        keep.append(msg)
    cpu = time.process_time() - c0
    assert bytes(msg[2]["images"][3]) == payload["images"][3] and msg[2]["images"][3].readonly
    os.waitpid(pid, 0)
    b.close()
    return 1000 * cpu / (FRAMES * ROWS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    for rep in range(a.reps):
        before, now = measure(_read_frame_zeroed), measure(_read_frame)
        print(
            f"rep {rep}: zeroed bytearray {before:.4f} ms/sample, numpy.empty {now:.4f} ms/sample ({now / before:.2f}x)"
        )


if __name__ == "__main__":
    main()
