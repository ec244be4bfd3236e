"""``python -m asyncload.train``: the training job's old address, kept working.

The trainer is an application and lives with the others in ``asyncload.tools.train``; this module only
forwards the command and the names (``from asyncload.train import UNet``), so that neither breaks.
"""

from __future__ import annotations

import sys
from typing import Any

if __name__ == "__main__":
    from asyncload.tools.train.job import main

    sys.exit(main())


def __getattr__(name: str) -> Any:
    if name.startswith("__"):  # not __path__: this is a module, and the trainer's modules have one home
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .tools import train

    return getattr(train, name)
