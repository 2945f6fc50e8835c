"""`python -m rill [flags]`: the launcher (see rill.launcher)."""

import sys

from rill.launcher import main

sys.exit(main())
