"""Every figure means one thing (issue 63): ``remote_bytes`` is the bytes received from the store as they
crossed the wire on every object-store path (the node store off, ``decode="store"``, a manifest), the node
store's hits and misses add up to the rows read with DataLoader workers too, a source that is not kept says
why as it is (louder where the user asked for the store), and a source's ``store_key`` carries no digest of
nothing. Against the suite's real SeaweedFS server and real Deep Lake datasets."""

from __future__ import annotations

import logging
import os
from collections import Counter
from typing import Any

import pytest
from torch.utils.data import DataLoader

from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource, ObjectStoreSource

from .conftest import ROWS, WORKER_START
from .remote_fixtures import RemoteData, png_bytes, stem, upload_files

pytestmark = pytest.mark.timeout(120)


def wire_bytes(data: RemoteData, rows: int) -> int:
    """The bytes of the objects an epoch GETs: every row's image and mask file, as uploaded."""
    return sum(len(png_bytes(data.images[i])) + len(png_bytes(data.masks[i])) for i in range(rows))


def epoch_rows(loader: Any) -> Counter[int]:
    return Counter(int(i) for b in loader for i in b["index"])


@pytest.mark.parametrize(
    "how",
    [
        {"cache": False},
        {"cache": False, "decode": "store"},
        {},  # the node store on (remote sources, by default), cold
        {"manifest": True, "cache": False},
    ],
    ids=["store-off", "decode-store", "store-on", "manifest"],
)
def test_remote_bytes_are_the_object_bytes_received_on_every_path(remote_data: RemoteData, how: dict) -> None:
    settings = dict(how)
    manifest = [stem(i) for i in range(remote_data.rows)] if settings.pop("manifest", False) else None
    src = ObjectStoreSource(remote_data.files_url, creds=remote_data.creds(), manifest=manifest)
    loader = AsyncLoader(src, batch_size=16, shuffle=True, hedge=None, **settings)
    assert epoch_rows(loader) == Counter(range(remote_data.rows))
    s = loader.stats()
    assert s["remote_bytes"] == wire_bytes(remote_data, remote_data.rows) == src.received_bytes()
    loader.close()


def test_a_warm_object_store_epoch_receives_no_object_bytes(remote_data: RemoteData) -> None:
    loader = AsyncLoader(ObjectStoreSource(remote_data.files_url, creds=remote_data.creds()), batch_size=16, hedge=None)
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert epoch_rows(loader) == Counter(range(remote_data.rows))
        s = loader.stats()
        if epoch == 0:
            assert (s["remote_bytes"], s["node_misses"], s["node_hits"]) == (wire_bytes(remote_data, 96), 96, 0)
        else:
            assert (s["remote_bytes"], s["node_misses"], s["node_hits"]) == (0, 0, 96)
    loader.close()


def test_with_dataloader_workers_hits_and_misses_add_up_to_the_rows_read(seg_url: str) -> None:
    """Two workers share blocks: a block one fetches whole brings the other's rows, which the other then
    reads from disk. Each row is a miss of the worker that read it from the source, or a hit of the one
    that found it on disk: never both, so a cold epoch's hits and misses add up to the rows read once."""
    ds = AsyncIterableDataset(
        DeepLakeSource(seg_url), batch_size=16, shuffle=True, seed=7, cache=True, shuffle_block=16, shuffle_window=64
    )  # blocks of 16 rows (the default would shuffle a dataset this small fully)
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = Counter(int(i) for b in DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=WORKER_START)
                      for i in b["index"])  # fmt: skip
        assert got == Counter(range(ROWS))
        s = ds.stats()
        assert s["node_hits"] + s["node_misses"] == ROWS, (epoch, s["node_hits"], s["node_misses"])
        if epoch == 1:
            assert (s["node_hits"], s["node_misses"], s["remote_bytes"]) == (ROWS, 0, 0)


def test_a_manifest_source_says_it_is_not_kept_for_want_of_etags(
    remote_data: RemoteData,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefix = f"files-manifest-{os.getpid()}"
    upload_files(remote_data.server, remote_data.bucket, prefix, remote_data.images[:8], remote_data.masks[:8])
    url = f"s3://{remote_data.bucket}/{prefix}"
    why = (
        f"asyncload: {url} is not kept on the node block store: a manifest names the objects' keys but gives no "
        "ETags, so an object rewritten under its key could not be told from the copy kept (without a manifest, "
        "the listing gives them); every epoch reads it from the store"
    )
    caplog.set_level(logging.INFO, logger="asyncload")
    for cache, level in (("auto", logging.INFO), (True, logging.WARNING)):  # asked for: a warning
        caplog.clear()
        src = ObjectStoreSource(url, creds=remote_data.creds(), manifest=[stem(i) for i in range(8)])
        with AsyncLoader(src, batch_size=4, cache=cache) as loader:
            assert epoch_rows(loader) == Counter(range(8))
            assert (loader.stats()["node_hits"], loader.stats()["node_misses"]) == (0, 0)
        said = [(r.levelno, r.getMessage()) for r in caplog.records if "is not kept" in r.getMessage()]
        assert said == [(level, why)]


def test_a_store_key_names_the_class_without_a_digest_of_no_code(seg_url: str, remote_data: RemoteData) -> None:
    """asyncload's own classes are named; a user's subclass that changes ``read`` carries its code's digest."""
    src = DeepLakeSource(seg_url)
    src.open()
    assert src.store_key is not None and src.store_key.startswith(f"DeepLakeSource {src.url}")
    assert "e3b0c44298fc" not in src.store_key  # (sha256 of no bytes)
    src.close()
    files = ObjectStoreSource(remote_data.files_url, creds=remote_data.creds())
    files.open()
    assert files.store_key is not None and files.store_key.startswith(f"ObjectStoreSource {files.url}|")
    files.close()

    class Mine(DeepLakeSource):
        async def read(self, indices: list[int], raw: frozenset[str] = frozenset()) -> Any:
            return await super().read(indices, raw)

    mine = Mine(seg_url)
    mine.open()
    name, digest = mine.store_key.split(" ", 1)[0].rsplit(":", 1)
    assert name.endswith(".Mine") and len(digest) == 12 and digest != "e3b0c44298fc"
    mine.close()
