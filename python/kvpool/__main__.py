"""``python -m kvpool simulate ...`` (same as the ``kvpool`` command)."""

import sys

from kvpool.cli import main

sys.exit(main())
