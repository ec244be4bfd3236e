"""`asyncload load` of the bench's 1,000-row PNG photo set on SeaweedFS behind 50 ms of packet-level RTT, run in the
client's namespace: each argument list of argv[1] (JSON) one run of the command."""

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks.testbeds import netem
from benchmarks.testbeds import world as W


def run(url, creds, args):
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": creds["aws_access_key_id"],
        "AWS_SECRET_ACCESS_KEY": creds["aws_secret_access_key"],
        "AWS_REGION": creds.get("aws_region", "us-east-1"),
    }
    p = subprocess.run(
        [sys.executable, "-m", "asyncload", "load", url, "--endpoint", creds["endpoint_url"], *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(Path(__file__).resolve().parents[4]),
        timeout=600,
    )
    return p.stdout[-4000:] + p.stderr[-1500:]


with W.world(Path(__file__).resolve().parents[4] / "data" / "bench") as w:
    w.add("png", W.DatasetSpec(rows=1000, image_format="png", size=256))
    w.set_rtt(50)
    for args in json.loads(sys.argv[1]):
        print(netem.fork_call(w.net.enter_client, run, w.url("png", False), w.creds, args, timeout=700))
