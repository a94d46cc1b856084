"""`python -m bnrewrite`: the command line (see bnrewrite.cli)."""

import sys

from bnrewrite.cli import main

if __name__ == "__main__":
    sys.exit(main())
