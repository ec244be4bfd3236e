"""The ``asyncload`` command: make a dataset, load one and report throughput, run the demo.

Bad input never ends in a traceback: ``main`` turns any error into one line on stderr,
``asyncload <cmd>: <what is wrong>``, and an exit status: 2 for a usage error (an argument or a setting,
``ConfigError``), 1 for a data or I/O error (a missing dataset, column or file, a failed read), 130 for
Ctrl-C. ``--debug`` (before or after the subcommand) or ``ASYNCLOAD_DEBUG=1`` prints the traceback too.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from ..runtime.sizes import SIZE_FORMS, parse_size

DEFAULT_DATA = os.path.join("data", "synthetic-seg")
USAGE_ERROR, DATA_ERROR, INTERRUPTED = 2, 1, 130
#: What ``asyncload --help`` says above the commands: plain text for a terminal (the module docstring is
#: reStructuredText for the API pages, and its ``double backquotes`` would show as they are).
DESCRIPTION = """\
Feed PyTorch training from remote tensor stores. This command measures a dataset against a synchronous
loop, makes a synthetic one, shows what one holds, and trains the example U-Net.

Bad input is one line on stderr, "asyncload <command>: <what is wrong>", with exit status 2 for a bad
argument or setting, 1 for a missing dataset, column or file or a failed read, and 130 for Ctrl-C.
--debug (before or after the command) or ASYNCLOAD_DEBUG=1 prints the traceback too."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (argparse prints the whole usage first); subparsers
    inherit the class, so ``asyncload load --batch-size x`` answers the same way."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE_ERROR, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _add_debug(p: argparse.ArgumentParser, default: Any) -> None:
    """``--debug`` on the top parser (default False) and on each subcommand (default SUPPRESS, so a
    subcommand that is not given it leaves the top parser's answer alone)."""
    p.add_argument("--debug", action="store_true", default=default, help="print the traceback of an error")


def _concurrency(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"concurrency={text!r} is not allowed: 'auto' or an int >= 1")
    return value


def _processes(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"processes={text!r} is not allowed: 'auto' or an int >= 0")
    return value


def _add_load_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--columns", default="images,masks", help="comma-separated columns (default: images,masks)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch (default 32)")
    p.add_argument("--concurrency", type=_concurrency, default="auto", help="samples read at once, or 'auto' (default)")
    p.add_argument("--prefetch", type=int, default=4, help="ready batches kept ahead")
    p.add_argument("--read-mode", choices=("auto", "column", "row"), default="auto",
                   help="one request per column of a batch, or per row; auto (default): the source's choice")  # fmt: skip
    p.add_argument(
        "--decode", default="auto", metavar="{auto,cpu,store,cuda,cuda:N}",
        help="where images are decoded: asyncload's decoders on the CPU, the store's, or the GPU (default auto)",
    )  # fmt: skip
    p.add_argument(
        "--processes", type=_processes, default=None,
        help="reader processes: an int (0: read in this process) or 'auto'; default: the loader's",
    )  # fmt: skip
    p.add_argument("--shuffle", action="store_true", help="a new order each epoch, in blocks (default: in order)")
    p.add_argument("--seed", type=int, default=0, help="the shuffle's and the augmentation's seed (default 0)")


def _mix(text: str) -> tuple[str, float]:
    """``--mix URL=WEIGHT`` (or a URL alone, weight 1); the weight after the last ``=``."""
    url, sep, weight = text.rpartition("=")
    if not sep:
        return text, 1.0
    try:
        return url, float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mix {text!r} is not allowed: URL=WEIGHT, a number after '='") from None


def _size(text: str) -> int | tuple[int, int]:
    """``256`` or ``256x320`` (height x width)."""
    try:
        parts = [int(x) for x in text.lower().split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: N or HxW, e.g. 256 or 224x320")
    return parts[0] if len(parts) == 1 else (parts[0], parts[1])


def _span(text: str) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range: LO,HI, e.g. 0.25,1") from None
    return lo, hi


def _bytes(text: str) -> int | str:
    """``auto``, or a size by the one rule of every size setting (``runtime.sizes``): ``500MB`` is 10^6
    bytes × 500, ``512MiB`` and ``512M`` are 2^20 × 512."""
    if text == "auto":
        return text
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size in bytes: auto or {SIZE_FORMS}") from None


def _normalize(text: str) -> Any:
    """``imagenet``, ``half`` or ``MEAN/STD`` with comma-separated channels: ``0.5,0.5,0.5/0.25,0.25,0.25``."""
    from .compare import NORMALIZE

    if text in NORMALIZE:
        return NORMALIZE[text]
    try:
        mean, std = (tuple(float(x) for x in part.split(",")) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a normalization: imagenet, half, or MEAN/STD such as 0.5,0.5,0.5/0.25,0.25,0.25"
        ) from None
    return mean, std


def _add_model_options(p: argparse.ArgumentParser) -> None:
    """The loader's image settings, flag by flag (``asyncload load``): augment, ragged, model-ready."""
    g = p.add_argument_group("images (the loader's augment=, ragged=, normalize=, layout=, dtype=)")
    g.add_argument("--resize", type=_size, metavar="N|HxW", help="Resize(N): every image and mask to one size")
    g.add_argument("--keep-aspect", action="store_true", help="with --resize: letterbox instead of stretching")
    g.add_argument("--crop", type=_size, metavar="N|HxW", help="RandomResizedCrop(N): random crops, resized to N")
    g.add_argument("--crop-scale", type=_span, default=(0.08, 1.0), metavar="LO,HI",
                   help="area of a --crop, a fraction of the image's (default 0.08,1)")  # fmt: skip
    g.add_argument("--flip", type=float, nargs="?", const=0.5, default=None, metavar="P",
                   help="RandomHorizontalFlip(P), default P 0.5")  # fmt: skip
    g.add_argument("--ragged", choices=("list", "pad"),
                   help="images of many sizes without a resize: lists of tensors, or padded with a <column>_mask")  # fmt: skip
    g.add_argument("--normalize", type=_normalize, metavar="imagenet|half|MEAN/STD",
                   help="model-ready images: scaled to 0..1 then (x - mean) / std")  # fmt: skip
    g.add_argument("--layout", choices=("NHWC", "NCHW"), default=None,
                   help="image tensors as [B, H, W, C] (NHWC, the default) or [B, C, H, W] (NCHW, what a conv net takes)")  # fmt: skip
    g.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="image tensors as this float type, scaled to 0..1 (and normalized with --normalize; default uint8, "
                   "or float32 with --normalize)")  # fmt: skip


def loader_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``AsyncLoader`` settings the flags of ``asyncload load`` name; defaults are left out, so the
    loader's own apply and the report lists only what was set."""
    from ..image.augment import RandomHorizontalFlip, RandomResizedCrop, Resize

    s: dict[str, Any] = {"batch_size": args.batch_size, "shuffle": args.shuffle, "seed": args.seed}
    for key in ("concurrency", "prefetch", "read_mode", "decode"):
        if getattr(args, key) != {"concurrency": "auto", "prefetch": 4, "read_mode": "auto", "decode": "auto"}[key]:
            s[key] = getattr(args, key)
    for key in ("processes", "memory_budget", "cpu_workers", "max_concurrency", "on_error", "ragged", "normalize",
                "layout", "log_every"):  # fmt: skip
        if getattr(args, key, None) is not None:
            s[key] = getattr(args, key)
    if args.dtype is not None:
        import torch

        s["dtype"] = getattr(torch, args.dtype)
    if args.resize is not None and args.crop is not None:
        from ..errors import ConfigError

        raise ConfigError("--resize and --crop are not allowed together: one resize per sample (pick one)")
    ops: list[Any] = []
    if args.resize is not None:
        ops.append(Resize(args.resize, keep_aspect=args.keep_aspect))
    if args.crop is not None:
        ops.append(RandomResizedCrop(args.crop, scale=args.crop_scale))
    if args.flip is not None:
        ops.append(RandomHorizontalFlip(args.flip))
    if ops:
        s["augment"] = ops
    return s


def _add_source_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--creds", metavar="JSON_FILE", help="Deep Lake credentials (e.g. aws_access_key_id, endpoint_url)")
    p.add_argument("--endpoint", metavar="URL", help="an S3 endpoint (MinIO, SeaweedFS, R2...): creds' endpoint_url")
    p.add_argument("--token", help="Activeloop token (al:// datasets)")
    p.add_argument("--profile", help="AWS shared-config profile for s3:// datasets")
    p.add_argument("--version", help="a tag, branch or commit id to read instead of the main branch's head")
    p.add_argument("--query", help='a TQL query whose rows are read, e.g. "SELECT * WHERE label = 1"')


def _cmd_make(args: argparse.Namespace) -> int:
    from .synthetic import make_dataset

    url = make_dataset(
        args.url, args.rows, height=args.size, width=args.size, image_format=args.format,
        seed=args.seed, overwrite=args.overwrite,
    )  # fmt: skip
    print(f"wrote {args.rows} rows to {url}")
    return 0


def _load_and_report(url: str, args: argparse.Namespace, sequential_limit: int) -> None:
    """Time the sequential baseline, then asyncload. The source is opened and the loaders built first,
    so a missing dataset or column and a bad setting fail as asyncload's named errors before anything is
    timed, not as Deep Lake's from inside the baseline."""
    import dataclasses

    from ..loader import AsyncLoader
    from ..sources.deeplake import DeepLakeSource
    from .measure import measure, sequential, table

    columns = tuple(c for c in args.columns.split(",") if c)
    src = _source(args, columns) if getattr(args, "url", None) else DeepLakeSource(url, columns)
    src.open()
    modes = ("column", "row") if args.read_mode == "both" else (args.read_mode,)
    loaders = [
        AsyncLoader(
            src,
            args.batch_size,
            shuffle=args.shuffle,
            seed=args.seed,
            concurrency=args.concurrency,
            prefetch=args.prefetch,
            read_mode=mode,
            decode=args.decode,
            **({} if args.processes is None else {"processes": args.processes}),
        )  # fmt: skip
        for mode in modes
    ]
    base = measure("sequential", sequential(src, columns, sequential_limit), count=lambda _: 1)
    # named after the rows it read: a dataset shorter than the limit is read whole, not to the limit
    base = dataclasses.replace(base, name=f"sequential ds[i][col] ({base.samples} rows)")
    rows = [base]
    for loader in loaders:
        how = f"asyncload {loader.read_mode} reads, concurrency {args.concurrency}"
        if args.decode != "auto" or args.processes is not None:
            how += f", decode {args.decode}" + (f", processes {args.processes}" if args.processes is not None else "")
        rows.append(measure(how, loader))
    print(f"\n{len(src)} rows, columns {columns}, from {src.url}\n")
    print(table(rows, base))


def _show_stalls() -> None:
    """A stall shows while it lasts: the epoch's watchdog says every few seconds on ``asyncload.stall``
    "waiting for <url>: no answer for 12 s (deadline 120 s)" (INFO, silent unless shown, as here)."""
    import logging

    stall = logging.getLogger("asyncload.stall")
    if not stall.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("asyncload load: %(message)s"))
        stall.addHandler(handler)
    stall.setLevel(logging.INFO)
    stall.propagate = False


def _cmd_load(args: argparse.Namespace) -> int:
    """``asyncload load``: the dataset at ``url`` through the synchronous loop and asyncload, timed alike
    (``asyncload.tools.compare``)."""
    import logging

    from ..engine.options import LoaderOptions
    from ..errors import CollateError, ConfigError
    from .compare import choose_source, compare, mix_of, store_used
    from .report import machine, print_report, report

    if args.repeat < 1:
        raise ConfigError(f"--repeat={args.repeat} is not allowed: an int >= 1")
    if args.epochs < 1:
        raise ConfigError(f"--epochs={args.epochs} is not allowed: an int >= 1")
    store = _store(args)
    columns = tuple(c for c in args.columns.split(",") if c)
    settings = loader_settings(args)
    LoaderOptions.of(settings)  # a bad setting fails here, named, before anything is opened
    _show_stalls()
    if args.log_every is not None:  # live stats are INFO lines of the "asyncload" logger: show them
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
        logging.getLogger("asyncload").setLevel(logging.INFO)
    where, rows = choose_source(
        args.url, columns, args.source, creds=_creds(args), token=args.token, profile=args.profile,
        version=args.version, query=args.query, manifest=args.manifest,
    )  # fmt: skip
    if args.mix:  # the other datasets of a mixture: each found as the URL is (Deep Lake, or files)
        others = [
            (choose_source(u, columns, "auto", creds=_creds(args), token=args.token, profile=args.profile)[0], w)
            for u, w in args.mix
        ]  # fmt: skip
        where, rows = mix_of(where, others, args.weight, args.epoch_rows)
    elif args.weight != 1.0 or args.epoch_rows is not None:
        raise ConfigError("--weight and --epoch-rows are not allowed without --mix: they weigh a mixture's datasets")
    if not args.json:
        print(
            f"asyncload load: {rows} rows of {where.url} ({where.why}), {where.network}; "
            f"{args.repeat} run(s) of each reader, {args.epochs} epoch(s) each; asyncload's node store: "
            f"{store.describe(store_used(where, store))}",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    host = machine()  # the load average before our own runs add to it
    try:
        result = compare(
            where, columns, settings, repeat=args.repeat, baseline_rows=args.sequential_rows,
            baseline=not args.no_baseline, epochs=args.epochs, store=store,
        )  # fmt: skip
    except CollateError as exc:  # the library's words name its settings; here they are flags
        raise CollateError(f"{exc} (on the command line: --resize N, --crop N or --ragged list|pad)") from exc
    print_report(report(where, columns, rows, result, settings, args.repeat, host, args.epochs), args.json)
    return 0


def _store(args: argparse.Namespace) -> Any:
    """The node store asyncload's runs read through: a private, empty one per run (cold) unless the user
    names one (``--cache-dir``, or ``--warm``: the loader's default) or turns it off (``--cache off``)."""
    from ..errors import ConfigError
    from ..nodestore import default_root
    from .compare import Store

    cache: bool | str = "auto" if args.cache == "auto" else args.cache == "on"
    if cache is False:
        if args.cache_dir or args.warm:
            raise ConfigError(
                "--cache off is not allowed with --cache-dir or --warm: they name a store to read through"
            )
        return Store("off", False)
    if args.cache_dir and args.warm:
        raise ConfigError("--cache-dir and --warm are not allowed together: --warm is the default store's directory")
    if args.cache_dir or args.warm:
        return Store("yours", cache, str(Path(args.cache_dir).expanduser()) if args.cache_dir else str(default_root()))
    return Store("cold", cache)


def _creds(args: argparse.Namespace) -> dict[str, str] | None:
    """``--creds`` (a JSON file) with ``--endpoint`` merged in as ``endpoint_url``."""
    import json

    from ..errors import ConfigError

    creds: dict[str, str] = {}
    if getattr(args, "creds", None):
        with open(args.creds, encoding="utf-8") as f:  # a missing file is an I/O error: main says so
            text = f.read()
        try:
            creds = dict(json.loads(text))
        except ValueError as exc:
            raise ConfigError(f"--creds {args.creds}: not valid JSON ({exc})") from None
    if getattr(args, "endpoint", None):
        creds["endpoint_url"] = args.endpoint
    return creds or None


def _source(args: argparse.Namespace, columns: tuple[str, ...]) -> Any:
    """The ``DeepLakeSource`` that ``--creds``, ``--endpoint``, ``--token``, ``--version`` and ``--query``
    describe."""
    from ..sources.deeplake import DeepLakeSource

    return DeepLakeSource(
        args.url, columns, creds=_creds(args), token=args.token, version=args.version, query=args.query,
        profile=args.profile,
    )  # fmt: skip


def _cmd_inspect(args: argparse.Namespace) -> int:
    """Rows, and per column its type, the numpy dtype and shapes of the first ``--sample`` rows and their
    stored (compressed) bytes: what a read of a row costs on the wire before Deep Lake's chunking."""
    src = _source(args, ("*",))
    ds = src.dataset()
    rows = src._run_query(ds).tolist() if src.query is not None else list(range(len(ds)))
    where = src.url + (f" at version {args.version}" if args.version else "")
    print(f"{where}: {len(ds)} rows (commit {ds.version})")
    if src.query is not None:
        print(f"  query {args.query!r}: {len(rows)} rows")
    sample = rows[: args.sample]
    for col in ds.schema.columns:
        print(f"  {col.name:<12} {col.dtype}")
        print(f"    {_column_sample(ds, col.name, sample)}")
        meta = ds[col.name].metadata  # e.g. a mask column's class_names, which asyncload train reads
        if meta.keys():
            print("    metadata: " + ", ".join(f"{k}={meta[k]!r}" for k in meta.keys()))
    if ds.metadata.keys():
        print("  metadata: " + ", ".join(f"{k}={ds.metadata[k]!r}" for k in ds.metadata.keys()))
    return 0


def _column_sample(ds: Any, name: str, sample: list[int]) -> str:
    """``first 16 rows: numpy uint8, shapes (32, 32, 3), stored 1,704 B per sample (mean)``."""
    import numpy as np

    shapes, dtypes, stored = set(), set(), []
    for i in sample:
        a = np.asarray(ds[i][name])
        shapes.add(a.shape)
        dtypes.add(str(a.dtype))
        try:
            stored.append(len(ds[name].get_bytes(i)))
        except Exception:  # noqa: BLE001 - a column without stored bytes of its own (a link, a scalar)
            pass
    shown = ", ".join(map(str, sorted(shapes)[:4])) + (" ..." if len(shapes) > 4 else "")
    size = f", stored {sum(stored) / len(stored):,.0f} B per sample (mean)" if stored else ""
    return f"first {len(sample)} rows: numpy {'/'.join(sorted(dtypes)) or '-'}, shapes {shown or '-'}{size}"


def _cmd_demo(args: argparse.Namespace) -> int:
    import deeplake

    from ..sources.deeplake import normalize_url
    from .synthetic import make_dataset

    url = normalize_url(args.data)
    if not deeplake.exists(url) or len(deeplake.open_read_only(url)) != args.rows:
        print(f"making a synthetic segmentation dataset of {args.rows} rows at {url}", file=sys.stderr)
        make_dataset(url, args.rows, overwrite=True)
    args.columns, args.read_mode = "images,masks", "both"
    _load_and_report(url, args, min(args.rows, 500))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from .train_args import config_from_namespace

    cfg = config_from_namespace(args)  # a wrong config or flag fails here, before torch is imported
    from .train.job import train

    train(cfg)
    return 0


def source_checkout() -> Path | None:
    """The asyncload source checkout this package runs from (an editable install), or the one in the working
    directory: the benchmark suite needs its ``benchmarks/`` and ``configs/``, which an install does not carry."""
    for root in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (root / "benchmarks" / "suites" / "wan.py").is_file() and (root / "configs").is_dir():
            return root
    return None


def _cmd_bench(args: argparse.Namespace) -> int:
    """Runs the checkout's WAN suite (it needs the test server, the peers and the baselines)."""
    import runpy

    suite = Path(args.suite)
    if not suite.is_file():
        print(f"asyncload bench: {suite} not found; run it from a source checkout of asyncload", file=sys.stderr)
        return 2
    sys.argv = [str(suite), "--config", args.config] + [x for kv in args.set for x in ("--set", kv)]
    try:
        runpy.run_path(str(suite), run_name="__main__")
    except SystemExit as done:  # the suite ends with sys.exit(main())
        return int(done.code or 0)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    p = _Parser(prog="asyncload", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"asyncload {__version__}")
    _add_debug(p, False)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("make-dataset", help="write a synthetic segmentation dataset (images + masks)")
    m.add_argument("url", help="where to write: a path, file://, mem:// or s3:// URL")
    m.add_argument("--rows", type=int, default=2000)
    m.add_argument("--size", type=int, default=256, help="image height and width in pixels")
    m.add_argument("--format", choices=("png", "jpg"), default="png")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--overwrite", action="store_true", help="replace a dataset already at url")
    m.set_defaults(func=_cmd_make)

    ld = sub.add_parser(
        "load", help="read your dataset with asyncload and with a synchronous loop: whole-epoch samples/s, CPU, RSS",
        description="Read a dataset (Deep Lake, or image files under an object-store prefix) with a synchronous "
        "loop and with asyncload, each a whole epoch from opening the dataset, and report both, with the steady "
        "rate, CPU per sample and peak RSS of the whole process tree. Every asyncload run reads through a "
        "private, empty node store (cold, like the baseline's first epoch); --epochs N reports epochs 2..N "
        "apart, warm. No latency is emulated: the network is the one the URL reaches.",
    )  # fmt: skip
    ld.add_argument(
        "url", help="a Deep Lake dataset (path, file://, s3://, al://...) or an object-store prefix of files"
    )
    ld.add_argument(
        "--source", choices=("auto", "deeplake", "files"), default="auto",
        help="auto (default): Deep Lake when a dataset opens at the URL, else the files under an s3://, gs://, "
        "az:// or http(s):// prefix (ObjectStoreSource: <prefix>/<column>/<stem>.<ext>)",
    )  # fmt: skip
    ld.add_argument("--manifest", help="object-store files: a manifest (URL or local file) naming the rows")
    mx = ld.add_argument_group("a mixture (MixedSource): the URL and other datasets in fixed shares of each epoch")
    mx.add_argument(
        "--mix", type=_mix, action="append", default=[], metavar="URL=WEIGHT",
        help="another dataset of the mixture and its weight (repeat for more; URL alone: weight 1)",
    )  # fmt: skip
    mx.add_argument("--weight", type=float, default=1.0, help="the URL's own weight in the mixture (default 1)")
    mx.add_argument("--epoch-rows", type=int, help="rows of a mixed epoch (default: the datasets' rows summed)")
    _add_source_options(ld)
    _add_load_options(ld)
    _add_model_options(ld)
    g = ld.add_argument_group("more loader settings")
    g.add_argument(
        "--memory-budget",
        type=_bytes,
        metavar="BYTES",
        help="bytes the pipeline may hold: auto, 500MB (10^6), 512MiB or 512M (2^20)",
    )
    g.add_argument("--cpu-workers", type=int, help="threads decoding and augmenting (default: one per core)")
    g.add_argument("--max-concurrency", type=int, help="the most samples in flight concurrency=auto may choose")
    g.add_argument("--on-error", choices=("raise", "skip"), help="skip: leave bad samples out, counted")
    g.add_argument(
        "--log-every", type=float, metavar="S", help="print the loader's live stats every S seconds (stderr)"
    )
    r = ld.add_argument_group("the report")
    r.add_argument("--sequential-rows", type=int, default=500, help="rows the synchronous baseline reads (default 500)")
    r.add_argument("--no-baseline", action="store_true", help="time asyncload alone")
    r.add_argument(
        "--repeat", type=int, default=1, metavar="N", help="runs of each reader, alternating: median and range"
    )
    r.add_argument(
        "--epochs", type=int, default=1, metavar="N",
        help="epochs of each run on one open dataset: epoch 1 cold, epochs 2..N reported apart (warm)",
    )  # fmt: skip
    r.add_argument("--json", action="store_true", help="the report as JSON on stdout, for scripts")
    c = ld.add_argument_group(
        "asyncload's node store (cache=): by default each run reads through a private, empty one, removed "
        "after, so that every run's epoch 1 is cold"
    )
    c.add_argument("--cache", choices=("auto", "on", "off"), default="auto",
                   help="the loader's cache setting: auto (default: remote sources), on, off (no store)")  # fmt: skip
    c.add_argument("--cache-dir", metavar="DIR",
                   help="read through your store at DIR instead, shared by the runs and kept (runs find what "
                   "earlier ones left: labelled warm)")  # fmt: skip
    c.add_argument("--warm", action="store_true",
                   help="read through the loader's default store, as a later job on this machine does "
                   "($ASYNCLOAD_CACHE_DIR, else the first on a local disk of ~/.cache/asyncload/blocks and a "
                   "directory of your own under $TMPDIR, then /var/tmp)")  # fmt: skip
    ld.set_defaults(func=_cmd_load)

    i = sub.add_parser(
        "inspect", help="rows, columns, dtypes, shapes and stored bytes per sample of a Deep Lake dataset"
    )
    i.add_argument("url")
    _add_source_options(i)
    i.add_argument("--sample", type=int, default=16, help="rows whose shapes are read (default 16)")
    i.set_defaults(func=_cmd_inspect)

    t = sub.add_parser(
        "train", help="train the compact U-Net on a segmentation dataset: yours (--data) or a synthetic one",
        description="Train the compact U-Net. Without --data, on a synthetic dataset made on first use (the shipped "
        "config train_unet); with --data, on your Deep Lake dataset of images and uint8 class-id masks.",
    )  # fmt: skip
    from .train_args import add_train_flags

    add_train_flags(t)
    t.set_defaults(func=_cmd_train)

    checkout = source_checkout()
    if checkout is not None:  # offered only where it can run: an installed package has no benchmarks/
        b = sub.add_parser("bench", help="the benchmark suite: loaders compared under emulated network latency")
        b.add_argument("--config", default=str(checkout / "configs" / "bench_wan.yaml"))
        b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
        b.add_argument("--suite", default=str(checkout / "benchmarks" / "suites" / "wan.py"), help=argparse.SUPPRESS)
        b.set_defaults(func=_cmd_bench)

    d = sub.add_parser(
        "demo", help="the main job on the embedded default: make a small dataset, load it, print throughput"
    )
    d.add_argument("--data", default=DEFAULT_DATA, help=f"where the synthetic dataset lives (default {DEFAULT_DATA})")
    d.add_argument("--rows", type=int, default=1000)
    _add_load_options(d)
    d.set_defaults(func=_cmd_demo)
    for cmd in sub.choices.values():
        _add_debug(cmd, argparse.SUPPRESS)
    return p


def _explain(exc: Exception) -> tuple[int, str]:
    """The exit status and the one line for ``exc``. asyncload's own errors already name the URL, the
    column or the setting; an OSError names its file; anything else is unexpected, so its type is shown
    and the way to its traceback."""
    from ..errors import AsyncLoadError, ConfigError

    if isinstance(exc, ConfigError):
        return USAGE_ERROR, str(exc)
    if isinstance(exc, AsyncLoadError):
        return DATA_ERROR, str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:
        return DATA_ERROR, f"{exc.filename}: {exc.strerror or exc}"
    if isinstance(exc, OSError):
        return DATA_ERROR, str(exc) or type(exc).__name__
    return DATA_ERROR, f"{type(exc).__name__}: {exc} (--debug shows the traceback)"


def main(argv: Sequence[str] | None = None) -> int:
    """Run one subcommand. The single place where an error becomes one line and an exit status (see the
    module docstring): subcommands raise, none of them prints its own error."""
    args = build_parser().parse_args(argv)
    debug = args.debug or os.environ.get("ASYNCLOAD_DEBUG", "") not in ("", "0")
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        return INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - every error ends here as one line
        if debug:
            traceback.print_exc()
        status, line = _explain(exc)
        print(f"asyncload {args.command}: {' '.join(line.splitlines())}", file=sys.stderr)  # one line, always
        return status


if __name__ == "__main__":
    sys.exit(main())
