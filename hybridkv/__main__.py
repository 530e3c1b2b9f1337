"""``python -m hybridkv``: the same command line as the ``hybridkv`` console script."""

import sys

from hybridkv.cli import main

if __name__ == "__main__":
    sys.exit(main())
