"""``python -m veloxquant``: the command line (see ``veloxquant.tools.cli``)."""

import sys

from .tools.cli import main

sys.exit(main())
