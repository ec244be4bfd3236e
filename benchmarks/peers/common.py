"""What every reader module shares: opening a dataset the way its spec says."""

from __future__ import annotations

from typing import Any


def open_dataset(spec: dict[str, Any], pool: int | None = 64) -> Any:
    """The spec's dataset, read-only, with Deep Lake's storage pool set to ``pool`` first (the pool is
    process-wide and sized when a dataset opens; 64 is what the plain readers were tuned to on the WAN)."""
    import deeplake

    if pool is not None:
        deeplake.storage.set_concurrency(pool)
    creds = spec.get("creds")
    return deeplake.open_read_only(spec["url"], creds=creds) if creds else deeplake.open_read_only(spec["url"])
