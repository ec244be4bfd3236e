"""A real launcher: ``torchrun`` itself, two agents on this machine (``--nnodes 2 --nproc-per-node 2``, a c10d
rendezvous on loopback), each agent a simulated node with its own node store, reading a Deep Lake dataset on
a real S3 server (SeaweedFS). What torchrun sets (``GROUP_RANK`` from the rendezvous, ``LOCAL_WORLD_SIZE``,
``RANK``...) is what the loader reads, not a copy of it: every epoch exact, each node's ranks reading their
node's part every epoch, every row fetched once for the cluster, and every rank's figures on rank 0."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from .sources import RecordingSource

pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("process_storms")]

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 2

SCRIPT = """
import json, os, sys
import torch.distributed as dist
from asyncload import AsyncLoader
from tests.sources import RecordingSource
url, creds, log, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo")
loader = AsyncLoader(RecordingSource(url, log, creds=creds), batch_size=8, shuffle=True, seed=4, shuffle_block=8,
                     shuffle_window=32, processes=0, with_index=True)
rows = []
for epoch in range({epochs}):
    loader.set_epoch(epoch)
    rows.append([int(i) for b in loader for i in b["index"]])
env = {{k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")}}
with open(os.path.join(out, f"rank{{dist.get_rank()}}.json"), "w") as f:
    json.dump({{"env": env, "nodes": loader.sampler.nodes, "rows": rows, "store": os.environ["ASYNCLOAD_CACHE_DIR"],
               "reported": loader.stats().get("ranks_reported")}}, f)
loader.close()
dist.destroy_process_group()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_agents_read_exact_node_stable_epochs_fetching_each_row_once(remote_data, tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(epochs=EPOCHS))
    log, out = tmp_path / "reads.jsonl", tmp_path / "out"
    out.mkdir()
    port = _port()
    agents = []
    for agent in range(2):
        env = os.environ | {
            "ASYNCLOAD_CACHE_DIR": str(tmp_path / f"node{agent}"),  # each agent a node with its own store
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
        }
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "asyncload-test",
            "--rdzv-conf", f"is_host={'true' if agent == 0 else 'false'}", "--local-addr", "127.0.0.1",
            "--max-restarts", "0", str(script), remote_data.deeplake_url, json.dumps(remote_data.creds()),
            str(log), str(out),
        ]  # fmt: skip
        agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        said = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(s[-3000:] for s in said)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]

    # torchrun's own variables, as the rendezvous assigned them: two nodes of two ranks, numbered together
    groups = {r["env"]["GROUP_RANK"] for r in ranks}
    assert groups == {"0", "1"} and all(r["env"]["LOCAL_WORLD_SIZE"] == "2" for r in ranks)
    assert all(int(r["env"]["RANK"]) == 2 * int(r["env"]["GROUP_RANK"]) + int(r["env"]["LOCAL_RANK"]) for r in ranks)
    assert [r["nodes"] for r in ranks] == [2, 2, 2, 2]

    n = remote_data.rows
    for e in range(EPOCHS):  # every row once per epoch, but a pad of at most world - 1
        seen = Counter(i for r in ranks for i in r["rows"][e])
        assert set(seen) == set(range(n)) and sum(seen.values()) - n <= 3, e
    for g in ("0", "1"):  # a node's ranks read their node's part, the same rows every epoch
        mine = [r for r in ranks if r["env"]["GROUP_RANK"] == g]
        assert len({r["store"] for r in mine}) == 1
        assert {i for r in mine for i in r["rows"][0]} == {i for r in mine for i in r["rows"][1]}
    assert [r["reported"] for r in ranks] == [4, None, None, None]  # rank 0 heard every rank's epoch
    fetched = Counter(i for req in RecordingSource(remote_data.deeplake_url, log).reads for i in req)
    assert fetched == Counter(range(n))  # each row fetched once for the cluster, over both epochs
