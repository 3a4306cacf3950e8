"""python3 -m report (from benchmarks/): the command line of the report."""

import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
