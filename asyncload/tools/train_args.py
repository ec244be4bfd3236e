"""``asyncload train``'s command line: ``--config``, ``--set`` and the flags a user with their own dataset
sets first. Apart from the job (``asyncload.tools.train``, which imports torch) so that building the
``asyncload`` parser, and ``asyncload --version``, stay instant."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..runtime.settings import load_config, parse_overrides

#: ``asyncload train``'s flags for the settings a user with their own dataset sets first: flag → config key.
#: Each is the same as ``--set key=value``; the rest are reached with ``--set``.
FLAGS: dict[str, tuple[str, Any, str]] = {
    "--data": ("data", str, "the dataset: a path, file://, s3://, gcs://, azure:// or al:// URL (turns make_data off)"),
    "--image-column": ("image_column", str, "the image column (default images)"),
    "--mask-column": ("mask_column", str, "the mask column, uint8 class ids (default masks)"),
    "--classes": ("classes", int, "number of classes (default: the mask column's class_names metadata, else the data)"),
    "--class-names": ("class_names", str, "comma-separated class names, one per class id"),
    "--creds": (
        "creds",
        str,
        "a JSON file of Deep Lake creds (aws_access_key_id, aws_secret_access_key, endpoint_url)",
    ),
    "--endpoint": ("endpoint", str, "an S3 endpoint URL (MinIO, SeaweedFS, R2...)"),
    "--profile": ("profile", str, "an AWS shared-config profile"),
    "--token": ("token", str, "an Activeloop token (al:// datasets)"),
    "--rows": ("rows", int, "rows used, from the first (default with --data: all; 0: all)"),
    "--holdout": ("holdout", float, "fraction of the rows, from the end, held out for validation"),
    "--image-size": ("image_size", int, "validation images are resized to this side; training too without --crop"),
    "--crop": ("crop", int, "training reads random resized crops of this side"),
    "--flip": ("flip", float, "probability of a horizontal flip in training"),
    "--epochs": ("epochs", int, "epochs"),
    "--batch-size": ("batch_size", int, "samples per step"),
    "--checkpoint": ("checkpoint", str, "where the checkpoint goes ('null': none)"),
}


def add_train_flags(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--set`` and the flags of ``FLAGS`` (shared by ``asyncload train`` and
    ``python -m asyncload.train``)."""
    p.add_argument(
        "--config", default=None,
        help=f"a YAML file of TrainConfig keys, or a shipped config's name ({', '.join(_shipped())}); "
        "default train_unet",
    )  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key, e.g. --set loader=sync (repeatable)")  # fmt: skip
    for flag, (_, kind, text) in FLAGS.items():
        dest = "flag_" + flag[2:].replace("-", "_")
        p.add_argument(flag, dest=dest, type=kind, default=None, metavar=FLAGS[flag][0].upper(), help=text)


def _shipped() -> list[str]:
    """The shipped configs' names, found without importing the training job (and torch)."""
    return sorted(p.stem for p in (Path(__file__).resolve().parent / "train" / "configs").glob("*.yaml"))


def config_from_namespace(args: argparse.Namespace) -> Any:
    """The config of parsed ``add_train_flags`` arguments: the file, then the flags, then ``--set``."""
    over: dict[str, Any] = {}
    for flag, (key, _, _) in FLAGS.items():
        value = getattr(args, "flag_" + flag[2:].replace("-", "_"), None)
        if value is None:
            continue
        if key == "class_names":
            value = [n.strip() for n in value.split(",")]
        if key == "checkpoint" and value in ("null", "none", ""):
            value = None
        over[key] = value
    if "data" in over:  # a user's dataset: never write synthetic rows there, and use all of it
        over.setdefault("make_data", False)
        over.setdefault("rows", 0)
    over.update(parse_overrides(args.overrides))
    from .train.config import TrainConfig, find_config

    path = find_config(args.config or "train_unet")
    return load_config(path, TrainConfig, over)
