"""What each process of one node reads from a Deep Lake dataset on S3 beyond its rows (issue 61).

    python benchmarks/suites/per_process_reads.py [--rows 1024] [--out benchmarks/results/partition]

A SeaweedFS server with a logging proxy in front of its S3 port (``harness.s3log``): every process is given
its own endpoint, so each request is known by the process (a rank and its reader process) that sent it,
with its object key, ``Range`` and the bytes its answer took on the wire. For each dataset (an image column
and a mask column, the mask sample- or chunk-compressed, small rows and larger ones) it runs, each with a
fresh node store:

- ``solo``: one process, one shuffled epoch (the baseline the targets are ratios of);
- ``4x2``: 4 ranks of one node, 2 epochs;

and sorts the requests by the kind of object they read (``kind``): Deep Lake's version log and metadata,
the data chunks (a chunk's rows and its header), the bucket probe asyncload sends before opening.
Results: ``per_process_reads.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RANK = """
import json, sys, time
sys.path.insert(0, {root!r})
from asyncload import AsyncIterableDataset, AsyncLoader, DeepLakeSource
{patch}
src = DeepLakeSource({url!r}, creds={creds!r})
opts = dict(rank={rank}, world_size={world}, batch_size=32, shuffle=True, seed=1, **{options!r})
workers = {workers}
if workers:
    from torch.utils.data import DataLoader
    ds = AsyncIterableDataset(src, **opts)
else:
    loader = AsyncLoader(src, **opts)
out = []
for e in range({epochs}):
    t0, first, rows = time.perf_counter(), None, []
    if workers:
        ds.set_epoch(e)
        batches = DataLoader(ds, batch_size=None, num_workers=workers, multiprocessing_context="forkserver")
    else:
        loader.set_epoch(e)
        batches = loader
    for b in batches:
        first = first if first is not None else time.perf_counter() - t0
        rows += [int(i) for i in b["index"]]
    s = {{}} if workers else loader.stats()
    out.append({{"rows": sorted(rows), "hits": s.get("node_hits"), "misses": s.get("node_misses"),
                "remote": s.get("remote_bytes"), "first_batch_s": round(first, 3),
                "epoch_s": round(time.perf_counter() - t0, 2)}})
if not workers:
    loader.close()
print(json.dumps(out))
"""


#: What other ways of cutting the reads would cost, measured by changing them in the ranks of a probe only
#: (``--patch``): the start's parts off (each block one run), every part read as its whole block (one fetch per
#: block and node), and the whole blocks read in aligned groups of 4 (one fetch per 256 rows and node).
PATCHES = {
    "ramp-off": "import asyncload.engine.blocks as b; b.RAMP_BLOCKS = 10**9",
    "whole-blocks": """
import asyncload.engine.blocks as b
_cut = b.BlockReads._cut
def _whole_cut(self, block, rows):
    _cut(self, block, rows)
    self._whole = set(self._due)
b.BlockReads._cut = _whole_cut
""",
}
PATCHES["groups-4"] = (
    PATCHES["whole-blocks"]
    + """
_read_part = b.BlockReads._read_part
async def _group_read(self, part, ahead, raw):
    if self.shelf is None or self._full or self.block is None:
        return await _read_part(self, part, ahead, raw)
    rows = self._due.pop(part)
    try:
        g = 4 * self.block
        lo = rows[0] // g * g
        rows = sorted(set(rows) | set(self.shelf.valid(range(lo, min(lo + g, self.n)))))
        await self._fill(rows, raw, keep=True, lock=True)
    finally:
        del self._reading[part]
        self._ahead -= ahead
b.BlockReads._read_part = _group_read
"""
)


def kind(key: str, method: str, rng: str | None) -> str:
    """The kind of object a request reads (Deep Lake 4.7.4's layout on an object store): a data file is
    ``<dataset>/<column dir>/<xx>/<name>``; its first 32 KiB (``bytes=0-32767``) hold the header (where each
    page of rows lies), every other range is a page of rows (a chunk-compressed file is one page, read whole)."""
    if not key:
        return "open: bucket probe and listings"
    name = key.split("/", 1)[1] if "/" in key else key  # after the dataset's prefix
    if name.startswith("_deeplake_log"):
        return "open: version log"
    if method != "GET" or name.count("/") != 2:
        return f"other ({method} {name.split('/', 1)[0]})"
    end = rng.removeprefix("bytes=0-") if rng is not None and rng.startswith("bytes=0-") else ""
    if end.isdigit() and int(end) < 1 << 16:  # (``bytes=0-``: a chunk-compressed file, read whole as its page)
        return "data file header"
    return "pages"


def build(server: Any, bucket: str, prefix: str, rows: int, side: int, masks: str) -> str:
    """A dataset of ``rows`` noise images (side × side RGB, PNG: ~3·side² bytes a row, noise does not
    compress) and masks of 4 classes, ``masks``: ``"sample"`` (lz4 per row) or ``"chunk"`` (lz4 per chunk)."""
    import deeplake
    import numpy as np

    url = f"s3://{bucket}/{prefix}"
    creds = server.creds()
    ds = deeplake.create(url, creds=creds)
    ds.add_column("images", deeplake.types.Image(dtype="uint8", sample_compression="png"))
    spec = {"sample_compression": "lz4"} if masks == "sample" else {"chunk_compression": "lz4"}
    ds.add_column("masks", deeplake.types.SegmentMask(dtype="uint8", **spec))
    rng = np.random.default_rng(0)
    for start in range(0, rows, 64):
        n = min(64, rows - start)
        ds.append({
            "images": [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(n)],
            "masks": [np.repeat(rng.integers(0, 4, (side // 8 + 1, side), dtype=np.uint8), 8, axis=0)[:side] for _ in range(n)],
        })  # fmt: skip
    ds.commit("probe")
    del ds
    return url


def run(
    proxy: Any,
    server: Any,
    url: str,
    world: int,
    epochs: int,
    options: dict[str, Any],
    patch: str = "",
    nodes: int = 1,
    one_endpoint: bool = False,
    workers: int = 0,
) -> list[Any]:
    """``world`` ranks on ``nodes`` simulated nodes (a fresh node store each, and the variables torchrun gives a
    node's ranks), each rank with its own endpoint on ``proxy`` (``one_endpoint``: all on the first, as in a
    real job, so that a node's ranks can share one reader: the requests are then known by node only);
    ``patch``: code each rank runs first; ``workers``: DataLoader workers of each rank (``AsyncIterableDataset``)."""
    local = world // nodes
    stores = [tempfile.mkdtemp(prefix="ppr-store-") for _ in range(nodes)]
    procs = []
    for r in range(world):
        creds = server.creds() | {"endpoint_url": proxy.url("r0" if one_endpoint else f"r{r}")}
        env = os.environ | {"ASYNCLOAD_CACHE_DIR": stores[r // local]}
        if nodes > 1:
            env |= {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(r // local),
                    "RANK": str(r), "LOCAL_RANK": str(r % local)}  # fmt: skip
        code = RANK.format(
            root=str(ROOT),
            url=url,
            creds=creds,
            rank=r,
            world=world,
            epochs=epochs,
            options=options,
            patch=patch,
            workers=workers,
        )
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env))
    try:
        return [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for store in stores:
            shutil.rmtree(store, ignore_errors=True)


def summary(entries: list[Any]) -> dict[str, Any]:
    """Bytes and requests per process and kind of object. A page is counted once as ``pages`` where it is
    first fetched on the node, and as ``pages again`` (another process's) or ``pages again (same process)``
    each time after: what a node pays beyond the rows is the headers, the opens and the pages again."""
    per: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    seen: dict[tuple[str, str | None], set[str]] = defaultdict(set)  # a page -> the processes that fetched it
    for e in entries:
        k = kind(e.key, e.method, e.range)
        if k == "pages":
            by = seen[(e.key, e.range)]
            if by:
                k = "pages again (same process)" if by == {e.label} else "pages again"
            by.add(e.label)
        per[e.label][k][0] += 1
        per[e.label][k][1] += e.received + e.sent
    kinds = sorted({k for ks in per.values() for k in ks})
    total = {k: sum(ks[k][1] for ks in per.values() if k in ks) for k in kinds}
    return {
        "per_process": {lab: {k: {"requests": v[0], "bytes": v[1]} for k, v in ks.items()} for lab, ks in per.items()},
        "per_kind": total,
        "total_bytes": sum(e.received + e.sent for e in entries),
    }


def layout(server: Any, url: str) -> dict[str, Any]:
    """Each column's data files and the rows each holds (Deep Lake's private ``_datafiles_report``: a probe
    may read it, the library does not), and the bytes of a row as stored."""
    import deeplake

    ds = deeplake.open_read_only(url, creds=server.creds())
    files = {c: [(f.filename, f.offset_start, f.offset_end) for f in ds._datafiles_report[c].insert_datafiles]
             for c in ("images", "masks")}  # fmt: skip
    row = {c: len(ds[c].get_bytes([0])[0]) for c in ("images", "masks")}
    return {"files": files, "row_bytes": row}


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table of ``results``: per dataset and run, the bytes of each kind over all processes (MB),
    the opens per process (KB), and the run's bytes against one process's epoch."""
    kinds = ("pages", "pages again", "pages again (same process)", "data file header")
    head = "| image row | mask | run | total MB | ratio | " + " | ".join(kinds) + " | opens per process (KB) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        for name, run in r["runs"].items():
            k = run["per_kind"]
            procs = len(run["per_process"])
            opens = sum(v for n, v in k.items() if n.startswith("open")) / procs / 1e3
            cells = [f"{k.get(n, 0) / 1e6:.2f}" for n in kinds]
            lines.append(
                f"| {r['row_bytes']['images'] / 1e3:.1f} KB | {r['masks']} ({r['row_bytes']['masks']} B) | {name} | "
                f"{run['total_bytes'] / 1e6:.1f} | {r['ratios'][name]:.3f} | " + " | ".join(cells) + f" | {opens:.1f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--sides", default="66,96,136", help="image sides (66: ~13 KB rows, 96: ~28 KB, 136: ~55 KB)")
    p.add_argument("--masks", default="sample,chunk")
    p.add_argument("--worlds", default="4", help="ranks of the node in each run after the solo one")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--nodes", type=int, default=1, help="simulated nodes the ranks of each run are on")
    p.add_argument("--window", type=int, default=4096, help="shuffle_window")
    p.add_argument("--block", default="auto", help="shuffle_block")
    p.add_argument("--name", default="per_process_reads", help="the JSON file's name in --out")
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/partition"))
    p.add_argument("--raw", action="store_true", help="keep every request in the JSON")
    p.add_argument("--patch", choices=sorted(PATCHES), help="another cut of the reads, in the ranks (PATCHES)")
    p.add_argument("--table", nargs="*", help="print the table of these JSON files and stop")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers of each rank after the solo run")
    p.add_argument(
        "--one-endpoint",
        action="store_true",
        help="every rank on one endpoint (a node's ranks may share a reader; bytes by node, not process)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="an AsyncLoader option for every rank (a Python literal), e.g. shared_reader=False",
    )
    args = p.parse_args(argv)
    if args.table:
        print(table([r for f in args.table for r in json.loads(Path(f).read_text())]))
        return 0

    from harness.s3log import RequestLog
    from harness.seaweed import SeaweedServer

    worlds = [int(w) for w in args.worlds.split(",")]
    options = {"shuffle_window": args.window, "shuffle_block": args.block if args.block == "auto" else int(args.block)}
    for kv in args.set:
        k, v = kv.split("=", 1)
        options[k] = ast.literal_eval(v)
    patch = PATCHES[args.patch] if args.patch else ""
    results: list[dict[str, Any]] = []
    with SeaweedServer() as server:
        server.create_bucket("ppr")
        labels = [f"r{r}" for r in range(max(worlds))]
        with RequestLog(("127.0.0.1", server.port), labels) as proxy:
            for side in map(int, args.sides.split(",")):
                for masks in args.masks.split(","):
                    url = build(server, "ppr", f"s{side}-{masks}", args.rows, side, masks)
                    row = {"side": side, "masks": masks, "rows": args.rows, "options": options, "patch": args.patch,
                           "one_endpoint": args.one_endpoint,
                           **layout(server, url), "runs": {}}  # fmt: skip
                    for world, epochs in [(1, 1)] + [(w, args.epochs) for w in worlds]:
                        nodes = args.nodes if world > 1 else 1
                        workers = args.workers if world > 1 else 0
                        name = f"{world}x{epochs}" if nodes == 1 else f"{nodes} nodes x {world // nodes}x{epochs}"
                        name += f" ({workers} workers each)" if workers else ""
                        proxy.clear()
                        t0 = time.perf_counter()
                        outs = run(proxy, server, url, world, epochs, options, patch, nodes, args.one_endpoint, workers)
                        for e in range(epochs):  # every epoch exact over the ranks
                            assert sorted(i for o in outs for i in o[e]["rows"]) == list(range(args.rows)), (name, e)
                        got = summary(proxy.entries())
                        got["loader"] = [[{k: v for k, v in o[e].items() if k != "rows"} for e in range(epochs)]
                                         for o in outs]  # fmt: skip
                        got["seconds"] = round(time.perf_counter() - t0, 1)
                        if args.raw:
                            got["requests"] = [vars(e) for e in proxy.entries()]
                        row["runs"][name] = got
                    solo = row["runs"]["1x1"]["total_bytes"]
                    row["ratios"] = {n: round(r["total_bytes"] / solo, 3) for n, r in row["runs"].items()}
                    print(json.dumps({k: row[k] for k in ("side", "masks", "row_bytes", "ratios")}), flush=True)
                    results.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
