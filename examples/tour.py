"""Two scenarios on the real library, step by step (the same as ``kvpool tour``).

Run: ``python examples/tour.py``. Read python/kvpool/tour.py for the calls behind each row:
seed 003 (paged blocks: allocate, can_append / may_append, release, block size 4 against 8) and
seed 000 section 10.1 (a request's life in BlockManagerPool, then the reference counts).
"""

import sys

from kvpool.tour import main

sys.exit(main())
