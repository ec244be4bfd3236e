"""asyncload's first epoch on the bench's path, one case a fresh process: its time, CPU, stats, the time of
every 640th sample, and with ``TRACE`` a line every 0.1 s (seconds, samples read, in flight, requests,
samples yielded, concurrency, bytes fetched).

    python benchmarks/results/first_epoch/probes/trace_loader.py '[{}, {"OPTS": "{\"processes\": 0}"}]' png

A case is environment variables for the child: ``OPTS`` (the loader's options as JSON), ``SRC`` (the
source's), ``BS`` (batch size), ``TRACE``, ``SWITCH`` (``sys.setswitchinterval``); anything else is set as
it is.
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))


def run(url, creds, env):
    os.environ.update(env)
    if env.get("SWITCH"):
        sys.setswitchinterval(float(env["SWITCH"]))
    os.environ["ASYNCLOAD_CACHE_DIR"] = tempfile.mkdtemp()
    from asyncload import AsyncLoader, DeepLakeSource
    from benchmarks.peers.harness import tree_cpu_s

    c0 = tree_cpu_s(os.getpid())
    t0 = time.perf_counter()
    L = AsyncLoader(
        DeepLakeSource(url, creds=creds, **json.loads(os.environ.get("SRC", "{}"))),
        int(env.get("BS", 32)),
        shuffle=True,
        seed=0,
        **json.loads(os.environ.get("OPTS", "{}")),
    )
    n = 0
    first = None
    marks = []
    import threading

    trace = []
    stop = threading.Event()

    def sample():
        while not stop.wait(0.1):
            try:
                st = L.stats()
            except Exception:
                continue
            trace.append(
                (
                    round(time.perf_counter() - t0, 1),
                    st.get("samples_read"),
                    st.get("in_flight"),
                    st.get("requests"),
                    st.get("samples_yielded"),
                    st.get("concurrency"),
                    st.get("remote_bytes"),
                )
            )

    threading.Thread(target=sample, daemon=True).start()
    for b in L:
        n += len(b["index"])
        if first is None:
            first = time.perf_counter() - t0
        if n % 640 < int(env.get("BS", 32)):
            marks.append(round(time.perf_counter() - t0, 2))
    total = time.perf_counter() - t0
    cpu = tree_cpu_s(os.getpid()) - c0
    stop.set()
    if os.environ.get("TRACE"):
        for row in trace[:30]:
            print(row, file=sys.stderr)
    st = L.stats()
    L.close()
    keys = [
        "requests",
        "remote_bytes",
        "node_misses",
        "node_hits",
        "read_p50_ms",
        "concurrency",
        "waiting_on",
        "open_s",
        "read_s",
        "decode_s",
        "collate_s",
        "queue_s",
        "wait_s",
    ]
    return {
        "env": env,
        "first": round(first, 2),
        "total": round(total, 2),
        "cpu_ms": round(cpu / n * 1e3, 3),
        "rate": round(n / total),
        "marks": marks,
        **{k: st.get(k) for k in keys},
    }


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from raw_reads import each_case

    each_case(run, spread=False)
