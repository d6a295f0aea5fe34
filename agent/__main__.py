"""`python -m agent`: the node agent without Django (see agent/cli.py)."""

import sys

from agent.cli import main

sys.exit(main())
