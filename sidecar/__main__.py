"""``python -m sidecar``: the command line of :mod:`sidecar.cli.main`."""

import sys

from sidecar.cli import main

if __name__ == "__main__":
    sys.exit(main.main())
