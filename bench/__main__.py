"""``python -m bench`` is ``polyexec-bench``."""

import sys

from .cli import main

sys.exit(main())
