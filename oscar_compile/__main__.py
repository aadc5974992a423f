"""``python -m oscar_compile ...``: the ``oscar`` command without installing the package's scripts."""

import sys

from .cli import main

sys.exit(main())
