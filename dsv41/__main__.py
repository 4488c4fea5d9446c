"""``python -m dsv41 info|check|bench`` (dsv41/tools/cli.py)."""

import sys

from .tools.cli import main

sys.exit(main())
