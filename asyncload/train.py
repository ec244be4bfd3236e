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
    from .tools import train

    return getattr(train, name)
