"""``python -m veloxquant``: the command line (see ``veloxquant.cli``)."""

import sys

from .cli import main

sys.exit(main())
