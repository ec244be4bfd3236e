"""``python -m asyncload.train``: the training job (see ``asyncload.tools.train``)."""

import sys

from .job import main

sys.exit(main())
