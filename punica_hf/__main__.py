"""``python -m punica_hf``: the ``punica-hf`` command line."""

import sys

from .cli import main

sys.exit(main())
