"""``python -m toma``: the same command line as the ``toma`` console script."""

import sys

from toma.tools.cli import main

sys.exit(main())
