#!/usr/bin/env python3
"""The benchmark report's command line (the package benchmarks/report/; see --help)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from report.cli import main  # noqa: E402  (after the path: the package sits beside this file)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
