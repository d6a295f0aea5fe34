"""`python -m mockengine`: the bundled mock engine's server (see mockengine/server.py)."""

import sys

from mockengine.server import main

sys.exit(main())
