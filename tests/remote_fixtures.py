"""Fixtures for tests against a real S3 server (SeaweedFS ``weed mini`` on loopback).

Import them explicitly in a test module (they are not in conftest, so suites that do not need a server
never start one)::

    from .remote_fixtures import remote_data, seaweed  # noqa: F401

``seaweed`` is started once per session and always stopped (the context manager runs on any outcome,
and a finaliser in the server object kills it if the interpreter gets there first). ``remote_data``
writes the synthetic dataset twice into one bucket: as a Deep Lake dataset at ``s3://<bucket>/seg`` and
as plain PNG files ``s3://<bucket>/files/{images,masks}/<stem>.png`` for the object-store source, and
keeps the original arrays to compare pixels against.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from asyncload import make_dataset
from asyncload.synthetic import make_sample
from asyncload.testing.seaweed import SeaweedServer, WeedNotFoundError

REMOTE_ROWS = 96  # a few batches at any batch size used here; small enough to write in about a second
HEIGHT, WIDTH = 40, 56  # the same shape as the local test dataset (conftest)
BUCKET = "asyncload-test"


@dataclass(frozen=True)
class RemoteData:
    """Where the remote copies are and what they hold."""

    server: SeaweedServer
    bucket: str
    deeplake_url: str  # s3://bucket/seg
    files_url: str  # s3://bucket/files (images/<stem>.png, masks/<stem>.png)
    images: np.ndarray  # [N, H, W, 3] uint8, the originals
    masks: np.ndarray  # [N, H, W] uint8

    @property
    def rows(self) -> int:
        return len(self.images)

    def creds(self) -> dict[str, str]:
        return self.server.creds(self.bucket)


def stem(i: int) -> str:
    return f"{i:06d}"


def png_bytes(arr: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def upload_files(server: SeaweedServer, bucket: str, prefix: str, images: np.ndarray, masks: np.ndarray) -> None:
    """``<prefix>/images/<stem>.png`` (RGB) and ``<prefix>/masks/<stem>.png`` (grey) for every row."""
    jobs = [(f"{prefix}/images/{stem(i)}.png", images[i]) for i in range(len(images))]
    jobs += [(f"{prefix}/masks/{stem(i)}.png", masks[i]) for i in range(len(masks))]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda job: server.put_object(bucket, job[0], png_bytes(job[1])), jobs))


def originals(rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The synthetic rows exactly as ``make_dataset(seed=0)`` writes them."""
    pairs = [make_sample(np.random.default_rng([0, i]), HEIGHT, WIDTH) for i in range(rows)]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    """One SeaweedFS S3 server for the session (signatures checked), stopped at the end whatever happens."""
    try:
        server = SeaweedServer()
    except WeedNotFoundError as exc:
        pytest.skip(str(exc))
    with server:
        yield server


@pytest.fixture(scope="session")
def remote_data(seaweed: SeaweedServer) -> RemoteData:
    """The synthetic dataset on the server, as Deep Lake and as plain files (read-only for tests)."""
    seaweed.create_bucket(BUCKET)
    images, masks = originals(REMOTE_ROWS)
    url = make_dataset(
        f"s3://{BUCKET}/seg", REMOTE_ROWS, height=HEIGHT, width=WIDTH, creds=seaweed.creds(BUCKET), progress=False
    )
    upload_files(seaweed, BUCKET, "files", images, masks)
    return RemoteData(seaweed, BUCKET, url, f"s3://{BUCKET}/files", images, masks)


@pytest.fixture
def running_seaweed(seaweed: SeaweedServer) -> Iterator[SeaweedServer]:
    """The session server, guaranteed running before and after the test (for tests that stop it)."""
    seaweed.start()
    try:
        yield seaweed
    finally:
        seaweed.start()


def read_epoch(it: Iterator[dict], data: RemoteData, seen: list[int] | None = None) -> list[int]:
    """Consume ``it``; check every sample's pixels against the originals; return the indices seen."""
    seen = [] if seen is None else seen
    for b in it:
        idx = b["index"].tolist()
        for j, i in enumerate(idx):
            assert np.array_equal(b["images"][j].numpy(), data.images[i]), f"images differ at index {i}"
            assert np.array_equal(b["masks"][j].numpy(), data.masks[i]), f"masks differ at index {i}"
        seen += idx
    return seen
