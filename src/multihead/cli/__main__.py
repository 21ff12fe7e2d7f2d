"""``python -m multihead.cli``: the ``multihead`` command."""

import sys

from multihead.cli import main

sys.exit(main())
