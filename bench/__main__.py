"""`python -m bench`: see the package docstring (`python -m bench --help`)."""

import sys

from bench.cli import main

if __name__ == "__main__":
  sys.exit(main())
