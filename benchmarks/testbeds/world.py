"""The world a suite's readers read from: datasets on local disk and on SeaweedFS behind emulated latency.

``world()`` builds it and tears it down: the emulated network (``netem.network``: packet-level NFQUEUE
in two namespaces as root, else the TCP proxy), SeaweedFS (``harness.seaweed``) in the server namespace,
each photo-like dataset written once to local disk (cached under ``data/bench`` between runs) and
uploaded byte for byte to one bucket, plus the path-check objects. The orchestrating thread stays in the
server's namespace, so set-up and upload pay no delay; readers run in the client's (``peers.harness.Runner``).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import netem
from .photos import bytes_per_sample, make_photo_dataset

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class DatasetSpec:
    """One dataset: ``size`` a side in pixels, or ``None`` for variable shapes (240–640 px on the long
    side, aspect 0.6–1.7). ``maker``: ``photos`` (crops of real photographs, ``photos.py``) or
    ``synthetic`` (``asyncload.make_dataset``'s photo-like rows: rendered scenes with grain and noise)."""

    rows: int
    image_format: str = "jpg"
    size: int | None = 256
    mask_format: str = "lz4"
    noise_std: tuple[float, float] = (1.5, 3.5)
    maker: str = "photos"
    distinct: int | None = None  # photos maker: this many different rows, each stored rows/distinct times

    @property
    def dirname(self) -> str:
        shape = "var" if self.size is None else ("" if self.size == 256 else str(self.size))
        rows = f"{self.rows}x{self.distinct}" if self.distinct else str(self.rows)
        name = "-".join(x for x in (self.maker, shape, rows, self.image_format) if x)
        return name + ("-pngmask" if self.mask_format == "png" and self.size == 256 else "")

    def describe(self) -> str:
        shape = "240–640 px long side, aspect 0.6–1.7" if self.size is None else f"{self.size}×{self.size}"
        fmt = "JPEG q90" if self.image_format == "jpg" else "PNG"
        what = "photo-like (crops of photographs)" if self.maker == "photos" else "synthetic photo-like"
        made = f", {self.distinct:,} distinct rows" if self.distinct else ""
        return f"{self.rows:,} rows of {what} {shape} {fmt} images + {self.mask_format} masks ({self.maker}{made})"


def local_dataset(spec: DatasetSpec, data_dir: Path) -> Path:
    """The dataset on local disk, written unless a copy with as many rows is there."""
    import deeplake

    path = data_dir / spec.dirname
    url = f"file://{path}"
    if not deeplake.exists(url) or len(deeplake.open_read_only(url)) != spec.rows:
        print(f"writing {url} ({spec.describe()})", file=sys.stderr, flush=True)
        if spec.maker == "synthetic":
            from asyncload import make_dataset

            shape = (240, 640) if spec.size is None else (spec.size, spec.size)
            aspect = (0.6, 1.7) if spec.size is None else (1.0, 1.0)
            make_dataset(
                url, spec.rows, image_format=spec.image_format, sizes=shape, aspect=aspect,  # type: ignore[arg-type]
                mask_format=spec.mask_format, overwrite=True, progress=False,  # type: ignore[arg-type]
            )  # fmt: skip
        else:
            make_photo_dataset(
                url, spec.rows, image_format=spec.image_format, size=spec.size,  # type: ignore[arg-type]
                mask_format=spec.mask_format, noise_std=spec.noise_std,  # type: ignore[arg-type]
                distinct=spec.distinct, processes=os.cpu_count() or 1 if spec.distinct else 1,
                chunk=512 if spec.distinct else 64,
            )  # fmt: skip
    return path


class World:
    """The network, the server and the datasets of one suite run."""

    def __init__(self, net: netem.Network, server: Any, data_dir: Path) -> None:
        self.net, self.server, self.data_dir = net, server, data_dir
        self.bucket = server.create_bucket("bench")
        self.creds = {**server.creds(), "endpoint_url": net.url(server.port)}
        self.filer = net.url(int(server.filer_url.rsplit(":", 1)[1]))
        self.local: dict[str, Path] = {}
        netem.put_check_objects(server, self.bucket)

    def add(self, name: str, spec: DatasetSpec, upload: bool = True) -> None:
        """Write ``spec`` locally (once) and, if ``upload``, put its files on the server as ``name``."""
        self.local[name] = local_dataset(spec, self.data_dir)
        if upload:
            self.server.put_tree(self.bucket, name, self.local[name])  # the same bytes, no re-encoding

    def url(self, name: str, local: bool) -> str:
        return f"file://{self.local[name]}" if local else f"s3://{self.bucket}/{name}"

    def reader_creds(self, local: bool) -> dict[str, str] | None:
        return None if local else self.creds

    def set_rtt(self, ms: float) -> None:
        if self.net.rtt_s != ms / 1e3:
            self.net.set_rtt(ms / 1e3)

    def path_check_spec(self, ms: float) -> dict[str, Any]:
        """A ``Runner`` spec that measures the path (small GET, handshake, window growth) from the client."""
        return {"call": ("benchmarks.testbeds.netem", "check_path", (self.filer, self.bucket, ms / 1e3))}

    def describe(self) -> dict[str, Any]:
        import deeplake

        return {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
            f"deeplake {deeplake.__version__}",
            "network": self.net.describe(),
            "server": "SeaweedFS weed mini (harness.seaweed) in the server namespace",
        }


def sizes(path: Path) -> dict[str, float]:
    """Stored KB per sample of a local dataset (image, mask, total)."""
    b = bytes_per_sample(f"file://{path}")
    return {**b, "total": sum(b.values())}


@contextlib.contextmanager
def world(
    data_dir: Path | None = None, *, rate_mbit: float | None = None, force_proxy: bool = False
) -> Iterator[World]:
    """The network and the server, set up in the server's namespace; removed on exit."""
    from harness.seaweed import SeaweedServer

    data_dir = data_dir or ROOT / "data" / "bench"
    with netem.network(ROOT / "data" / "netem", rate_mbit=rate_mbit, force_proxy=force_proxy) as net:
        net.enter_server()  # the orchestrator sets up and uploads from the server's side: no delay
        with SeaweedServer(host=net.server_host) as server:
            yield World(net, server, data_dir)
