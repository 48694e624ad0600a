"""``python -m narwhal``: the ``narwhal`` command."""

import sys

from .cli import main

sys.exit(main())
