"""``python -m kvsched``: the same entry point as the ``kvsched`` console script."""

import sys

from kvsched.cli import main

sys.exit(main())
