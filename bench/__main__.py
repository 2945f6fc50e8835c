"""Entry point: `python -m bench {run,sweep,compare} ...`."""

import sys

from bench.cli import main

sys.exit(main())
