"""The tables of ``docs/reference.md``, rendered from the code at every build (``docs/conf.py``).

Why generated: a hand-kept table of settings drifts (the issue that made this page found four settings
missing from it). Here each table is read off its single source of truth:

- **settings**: ``LoaderOptions``'s fields (type and rule from ``setting()``, default) and the one
  description list in ``AsyncLoader``'s docstring (``help(AsyncLoader)``), grouped by its headings;
- **statistics**: ``STATS`` below, one row per key of ``loader.stats()`` with its unit; the keys are the
  code's, and ``tests/test_docs.py`` fails when a key of a live ``stats()`` has no row, or a row no key;
- **environment**: ``ENVIRONMENT`` below; ``tests/test_docs.py`` fails when the package reads a variable
  that has no row;
- **support matrix**: the version bounds of ``pyproject.toml`` and the pins of ``constraints.txt``.

``python docs/reference_tables.py`` prints them all; ``--write`` writes them into ``docs/reference/generated/``,
where they are committed, so that the page reads on GitHub too (``tests/test_docs.py`` fails when one is stale).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
import tomllib
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from asyncload import AsyncLoader, LoaderOptions  # noqa: E402
from asyncload.runtime.settings import _describe  # noqa: E402

#: ``loader.stats()``: key → (unit, what it counts). One row per key; tests/test_docs.py compares the keys
#: with a live loader's.
STATS: dict[str, tuple[str, str]] = {
    "elapsed_s": ("s", "seconds since the epoch started (to its end, once it ended)"),
    "waiting_on": ("stage", "what the training loop waits on: `\"training\"` (the loader keeps ahead: under 10% of the loop's time waiting), else `\"store\"`, `\"decode\"`, `\"augment\"`, `\"transform\"`, `\"collate\"` or `\"copy\"`; `\"start\"` before the first batch"),
    "waiting_on_why": ("text", "the verdict in a sentence, with the figures it rests on"),
    "consumer_wait_frac": ("fraction", "of the training loop's time spent waiting in `next()` (the first batch left out)"),
    "steady_wait_s": ("s", "the training loop's wait for batches, the first batch's left out"),
    "step_s": ("s", "the training loop's time between taking a batch and asking for the next (its step)"),
    "rank": ("index", "the rank this loader reads for"),
    "open_s": ("s", "opening the source (the loader's constructor)"),
    "read_s": ("s", "reads from the store (or the node block store), summed over requests"),
    "decode_s": ("s", "decoding images and masks on the CPU pool, summed over batches"),
    "augment_s": ("s", "augmentation (`augment=`) on the CPU pool, summed over batches"),
    "transform_s": ("s", "the user's `transform=` on the CPU pool, summed over batches"),
    "collate_s": ("s", "collating samples into batch tensors, summed over batches"),
    "queue_s": ("s", "batches waiting in the ready queue for the training loop, summed"),
    "cpu_workers": ("threads", "the CPU pool's threads"),
    "cpu_busy_frac": ("fraction", "of the CPU pool's capacity (threads × elapsed) spent on the stages above"),
    "wait_on_store_s": ("s", "of `steady_wait_s`, the part charged to batches being read"),
    "wait_on_decode_s": ("s", "of `steady_wait_s`, the part charged to decoding"),
    "wait_on_augment_s": ("s", "of `steady_wait_s`, the part charged to augmentation"),
    "wait_on_transform_s": ("s", "of `steady_wait_s`, the part charged to the user's transform"),
    "wait_on_collate_s": ("s", "of `steady_wait_s`, the part charged to collation"),
    "wait_on_other_s": ("s", "of `steady_wait_s`, the rest: the hand-over, the reorder buffer, failed batches"),
    "samples_per_s": ("samples/s", "samples yielded per second of `elapsed_s`"),
    "bytes_per_s": ("bytes/s", "bytes read from the source per second of `elapsed_s` (÷ 2**20 for MiB/s)"),
    "concurrency": ("samples", "samples allowed in flight now (moves with `concurrency=\"auto\"`)"),
    "concurrency_setting": ("setting", "the `concurrency` setting: `\"auto\"` or the int given"),
    "requests": ("count", "read requests issued to the source"),
    "samples_read": ("samples", "samples whose reads completed"),
    "in_flight": ("samples", "samples being read now"),
    "ready_batches": ("batches", "batches ready ahead of the consumer now"),
    "batches_yielded": ("batches", "batches handed to the consumer this epoch"),
    "samples_yielded": ("samples", "samples handed to the consumer this epoch"),
    "consumer_wait_s": ("s", "time the consumer spent blocked in `next()` waiting for a batch"),
    "skipped": ("samples", "samples left out by `on_error=\"skip\"`"),
    "skipped_samples": ("list", "the first 1,000 of them, as `(index, cause)`"),
    "worker_restarts": ("count", "reader or worker processes that died and were replaced"),
    "stalls": ("count", "outages of the store ridden out (silent, then answering again)"),
    "stall_wait_s": ("s", "time spent waiting them out"),
    "stalled_s": ("s or None", "while a stall lasts: time since the store last answered; else None"),
    "stall_timeout": ("s", "the deadline the epoch gives a silent store (`stall_timeout`)"),
    "hedges": ("count", "second requests sent for stragglers (`hedge`)"),
    "hedges_won": ("count", "second requests that answered first"),
    "retries": ("count", "requests retried by the object-store client (0 for Deep Lake)"),
    "time_to_first_batch_s": ("s or None", "from the epoch's start to its first batch"),
    "time_to_first_read_s": ("s or None", "from the epoch's start to the first answer of the store"),
    "reader_start_s": ("s or None", "the reader process's start: from spawning it to its imports done (None without one, or while it starts)"),
    "store_write_s": ("s", "writing fetched rows to the node block store, off the event loop, summed over writes"),
    "memory_budget": ("bytes", "the pipeline's byte budget (`memory_budget`, resolved)"),
    "bytes_held": ("bytes", "bytes read and decoded that the pipeline holds now, ready batches included"),
    "bytes_held_peak": ("bytes", "the most it held this epoch"),
    "cpu_loop_s": ("CPU s", "thread CPU time of the event-loop thread"),
    "cpu_decode_s": ("CPU s", "thread CPU time of the decode stage (decode, crop, resize, flip)"),
    "cpu_collate_s": ("CPU s", "thread CPU time of the rest of assembly (collation, your `transform`)"),
    "remote_bytes": ("bytes", "bytes received from the source this epoch. `ObjectStoreSource`: its GETs' response bodies as they crossed the wire (the files' stored bytes, whatever `decode=`; hedged and retried GETs count each time; the listing at open is not counted). Deep Lake, and any source that does not count its own bytes: the bytes of the values it handed over for the rows fetched (stored bytes where asyncload decodes; decoded arrays with `decode=\"store\"`), since Deep Lake does not report the chunk ranges it reads, which are larger. 0 for rows served from the node store"),
    "node_hits": ("rows", "rows this process read from the node block store's disk that it did not fetch itself this epoch (another worker, rank or an earlier epoch did); 0 without the store"),
    "node_misses": ("rows", "rows this process read that the node store did not have, fetched from the source; `node_hits + node_misses` is the rows it read (a block fetched whole brings other workers' rows too: their hits, not misses here); 0 without the store"),
    "node_hit_rate": ("fraction or None", "`node_hits / (node_hits + node_misses)`; None before any"),
    "node_not_kept": ("rows", "rows fetched that the node store did not keep (over `cache_limit`, or a failed write)"),
    "node_corrupt": ("count", "parts on disk that failed their checksum (deleted, fetched again)"),
    "node_read_bytes": ("bytes", "bytes read from the node store's disk"),
    "read_p50_ms": ("ms or None", "median latency of the recent 2,048 reads"),
    "read_p90_ms": ("ms or None", "90th percentile of the same"),
    "read_p99_ms": ("ms or None", "99th percentile of the same"),
    "read_mode": ("setting", "the read mode in use: `\"row\"` or `\"column\"`"),
    "epoch": ("int", "the epoch these figures are of (`set_epoch`)"),
}

#: Environment variables the package reads: name → (who reads it, what it does). tests/test_docs.py fails
#: when the package reads one that has no row here.
ENVIRONMENT: dict[str, tuple[str, str]] = {
    "ASYNCLOAD_CACHE_DIR": ("node block store", "where the store lives when `cache_dir` is not given"),
    "XDG_CACHE_HOME": ("node block store", "without the above: `$XDG_CACHE_HOME/asyncload/blocks` (else `~/.cache/asyncload/blocks`) where that is on a local disk"),
    "XDG_CONFIG_HOME": ("node block store", "where the key that signs the store's pickled values lives: `$XDG_CONFIG_HOME/asyncload/store.key` (else `~/.config/asyncload/store.key`), made on first use, private to the user"),
    "TMPDIR": ("node block store", "where the above is on a network or memory file system: `$TMPDIR/asyncload-<uid>/blocks` (a cluster job's node-local scratch), else `/var/tmp/asyncload-<uid>/blocks`; none local: the store is off, said once"),
    "ASYNCLOAD_DEBUG": ("`asyncload` command", "not empty and not `0`: print the traceback of an error (as `--debug`)"),
    "AWS_ACCESS_KEY_ID": ("S3", "the access key, when `creds` gives none"),
    "AWS_SECRET_ACCESS_KEY": ("S3", "its secret"),
    "AWS_SESSION_TOKEN": ("S3", "a session token for temporary keys"),
    "AWS_ENDPOINT_URL": ("S3", "the endpoint of an S3-compatible store (MinIO, SeaweedFS, R2); not on AWS itself"),
    "AWS_ENDPOINT_URL_S3": ("S3", "the same for S3 only; wins over `AWS_ENDPOINT_URL`"),
    "AWS_REGION": ("S3", "the region (else `AWS_DEFAULT_REGION`, the config file, or the bucket's own answer)"),
    "AWS_DEFAULT_REGION": ("S3", "the region, when `AWS_REGION` is not set"),
    "AWS_PROFILE": ("S3 (botocore)", "the profile of the shared files, when `profile=` is not given"),
    "AWS_CONFIG_FILE": ("S3", "the shared config file (default `~/.aws/config`)"),
    "AWS_SHARED_CREDENTIALS_FILE": ("S3", "the shared credentials file (default `~/.aws/credentials`)"),
    "GOOGLE_APPLICATION_CREDENTIALS": ("GCS (google-auth)", "a service account's key file"),
    "STORAGE_EMULATOR_HOST": ("GCS", "a GCS emulator's address (tests, local development)"),
    "AZURE_STORAGE_CONNECTION_STRING": ("Azure Blob", "a connection string (account, key or SAS, endpoint)"),
    "AZURE_STORAGE_ACCOUNT_NAME": ("Azure Blob", "the account (also `AZURE_STORAGE_ACCOUNT`)"),
    "AZURE_STORAGE_ACCOUNT": ("Azure Blob", "the account, when `AZURE_STORAGE_ACCOUNT_NAME` is not set"),
    "AZURE_STORAGE_ACCOUNT_KEY": ("Azure Blob", "the account key (also `AZURE_STORAGE_KEY`)"),
    "AZURE_STORAGE_KEY": ("Azure Blob", "the account key, when `AZURE_STORAGE_ACCOUNT_KEY` is not set"),
    "AZURE_STORAGE_SAS_TOKEN": ("Azure Blob", "a SAS token"),
    "AZURE_STORAGE_ENDPOINT": ("Azure Blob", "the Blob endpoint (Azurite, sovereign clouds)"),
    "OPENBLAS_NUM_THREADS": ("reader and worker processes", "BLAS threads in the processes asyncload starts (default 1 there)"),
    "MKL_NUM_THREADS": ("reader and worker processes", "the same for MKL"),
    "RANK": ("`asyncload train`", "torchrun's rank: the job joins the process group when this and `WORLD_SIZE` are set"),
    "WORLD_SIZE": ("`asyncload train`", "torchrun's number of ranks"),
    "LOCAL_RANK": ("`asyncload train`", "torchrun's rank on this node: which GPU the rank uses"),
    "LOCAL_WORLD_SIZE": ("`asyncload train`", "torchrun's ranks on this node"),
    "CI": ("`asyncload make-dataset`", "`true` and no terminal: no progress bar"),
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def setting_descriptions() -> list[tuple[str, list[tuple[list[str], str]]]]:
    """``AsyncLoader``'s docstring as (heading, [(names, description)]): the lines indented 6 spaces that
    start with a name (``shuffle, seed  ...``), their continuations joined."""
    groups: list[tuple[str, list[tuple[list[str], str]]]] = []
    item: tuple[list[str], list[str]] | None = None
    para: list[str] = []  # the paragraph a heading ends (a heading may take two lines)
    for line in (AsyncLoader.__doc__ or "").splitlines():
        entry = re.match(r"^ {6}([a-z_]+(?:, [a-z_]+)*)(?: +(\S.*))?$", line)
        if re.match(r"^ {4}\S", line):
            para.append(line.strip())
            if line.endswith(":"):  # "The node block store (``nodestore``): each ...:" → its name
                groups.append((re.split(r" \(|:", " ".join(para))[0], []))
                para = []
            item = None
        elif not line.strip():
            para = []
            item = None
        elif entry and groups:
            item = (entry.group(1).split(", "), [entry.group(2) or ""])
            groups[-1][1].append((item[0], " ".join(item[1])))
        elif item is not None and line.startswith(" " * 8) and line.strip():
            item[1].append(line.strip())
            groups[-1][1][-1] = (item[0], " ".join(p for p in item[1] if p))
    return [(h, items) for h, items in groups if items]


def _type_and_default(name: str) -> tuple[str, str]:
    fields = {f.name: f for f in dataclasses.fields(LoaderOptions)}
    if name in fields:
        f = fields[name]
        allowed = f.metadata.get("allowed") or _describe(typing.get_type_hints(LoaderOptions)[name])
        return allowed, repr(f.default)
    param = inspect.signature(AsyncLoader.__init__).parameters[name]  # rank, world_size, shard
    hint = {"shard": "None or a Shard", "rank": "None or an int >= 0", "world_size": "None or an int >= 1"}
    return hint.get(name, str(param.annotation)), repr(param.default)


def settings_md() -> str:
    """Every setting of ``AsyncLoader`` and ``AsyncIterableDataset``: name, what it takes, default, what
    it does, by the docstring's groups."""
    out = []
    for heading, items in setting_descriptions():
        out.append(f"### {heading}\n\n| setting | takes | default | what it does |\n|---|---|---|---|\n")
        for names, text in items:
            for name in names:
                takes, default = _type_and_default(name)
                out.append(f"| `{name}` | {_cell(takes)} | `{_cell(default)}` | {_cell(_rst_to_md(text))} |\n")
        out.append("\n")
    return "".join(out)


def _rst_to_md(text: str) -> str:
    return text.replace("``", "`")


#: Keys only rank 0 of a process group has, from the end of the first epoch every rank finished
#: (``engine.slowest``); tests/test_docs.py compares them with what ``slowest`` returns.
RANK_STATS: dict[str, tuple[str, str]] = {
    "slowest_rank": ("rank", "the rank that held the last epoch back: the one whose loop waited most for data where any waited 10% of its time or more, else the one whose epoch took longest; a rank that had not finished 5 s after rank 0"),
    "slowest_rank_waiting_on": ("stage", "that rank's `waiting_on` (`\"unfinished\"`: it had not finished its epoch)"),
    "slowest_rank_wait_frac": ("fraction", "that rank's `consumer_wait_frac`"),
    "slowest_rank_elapsed_s": ("s", "that rank's epoch, start to end"),
    "ranks_elapsed_s": ("s, by rank", "every rank's epoch, start to end"),
    "ranks_reported": ("ranks", "ranks whose figures reached rank 0 within 5 s of its epoch's end"),
    "ranks_not_finished": ("ranks", "ranks that had not finished the epoch then"),
}


def stats_md() -> str:
    rows = "".join(f"| `{k}` | {unit} | {_cell(what)} |\n" for k, (unit, what) in STATS.items())
    ranked = "".join(f"| `{k}` | {unit} | {_cell(what)} |\n" for k, (unit, what) in RANK_STATS.items())
    return (
        "| key | unit | what it is |\n|---|---|---|\n" + rows + "\nOn rank 0 of a `torch.distributed` process group "
        "(a loader or dataset built on every rank), each epoch's slowest rank:\n\n| key | unit | what it is |\n"
        "|---|---|---|\n" + ranked
    )


def environment_md() -> str:
    rows = "".join(f"| `{k}` | {who} | {_cell(what)} |\n" for k, (who, what) in ENVIRONMENT.items())
    return "| variable | read by | what it does |\n|---|---|---|\n" + rows


def support_md() -> str:
    """Python, OS, torch, Deep Lake, torchvision and the extras: the bounds pyproject.toml declares and
    what CI runs (constraints.txt's pins)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = dict(
        re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "constraints.txt").read_text(), re.M)
    )

    def spec(name: str, reqs: list[str]) -> str:
        for r in reqs:
            m = re.match(rf"^{re.escape(name)}\b\s*([^;]*)", r)
            if m:
                return m.group(1).strip() or "any"
        raise KeyError(f"{name} is not in pyproject.toml")

    deps, extras = project["dependencies"], project["optional-dependencies"]
    versions = [c.rsplit(":: ", 1)[1] for c in project["classifiers"] if re.search(r"Python :: 3\.\d+$", c)]
    oses = [c.rsplit(":: ", 1)[1] for c in project["classifiers"] if c.startswith("Operating System")]
    rows = [
        ("Python", project["requires-python"], "CPython " + ", ".join(versions), "the interpreter"),
        ("OS", ", ".join(oses), "Linux x86-64", "needs `flock` and `/proc` (node store, process accounting); macOS and Windows are not tested"),
        ("torch", spec("torch", deps), f"{pins.get('torch', '?')} (CPU build)", "installed by pip if absent: install your CUDA build first"),
        ("Deep Lake", spec("deeplake", deps), pins.get("deeplake", "?"), "4.7.4's traps are handled (Architecture); 4.8 is not yet allowed"),
        ("torchvision", spec("torchvision", extras["gpu"]) + " (`[gpu]` extra)", "not installed", "only for `decode=\"cuda\"` (nvJPEG); the build that matches your torch"),
        ("imagecodecs", spec("imagecodecs", extras["png"]) + " (`[png]`)", "tested", "libspng for PNG; without it OpenCV's libpng decodes PNG (slower), said once"),
        ("torchdata", spec("torchdata", extras["stateful"]) + " (`[stateful]`)", "tested", "`StatefulDataLoader`"),
        ("Lightning", spec("lightning", extras["lightning"]) + " (`[lightning]`)", "tested", "`asyncload.lightning.AsyncLoadCallback`"),
        ("botocore, google-auth, azure-identity", "`[s3]`, `[gcs]`, `[azure]`", "tested (SeaweedFS, emulators)", "the clouds' credential chains"),
    ]
    body = "".join(f"| {a} | {_cell(b)} | {_cell(c)} | {_cell(d)} |\n" for a, b, c, d in rows)
    return "| what | supported | CI runs | notes |\n|---|---|---|---|\n" + body


TABLES = {"settings": settings_md, "stats": stats_md, "environment": environment_md, "support": support_md}


#: Where the tables are committed: included by reference.md, read on GitHub as they are.
GENERATED = Path(__file__).resolve().parent / "reference" / "generated"


def write(folder: Path = GENERATED) -> list[str]:
    """Each table into ``folder/<name>.md``, rewritten only where it changed (for incremental builds);
    returns the names rewritten: stale where the folder is the committed one (``docs/conf.py`` warns)."""
    folder.mkdir(parents=True, exist_ok=True)
    rewritten = []
    for name, render in TABLES.items():
        path, text = folder / f"{name}.md", render()
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            rewritten.append(name)
    return rewritten


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:  # after a change to a setting, a stats() key or a pin: commit the result
        print("rewritten:", ", ".join(write()) or "none (fresh)")
    else:
        for name, render in TABLES.items():
            print(f"## {name}\n\n{render()}")
