"""`python -m kvxfer.cli`: the same entry point as the `kvxfer` console script."""

import sys

from kvxfer.cli import main

sys.exit(main())
