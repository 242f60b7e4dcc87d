"""``python -m cluster.backfill``: see :mod:`cluster.backfill.driver`."""

import sys

from cluster.backfill.cli import main

sys.exit(main())
