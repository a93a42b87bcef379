"""``python -m prefixserve.router.cli``: the ``prefixserve`` command without its console script."""

import sys

from prefixserve.router.cli import main

sys.exit(main())
