"""``python -m causalkv``: the command line."""

import sys

from causalkv.cli import main

sys.exit(main())
