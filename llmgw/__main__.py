"""`python -m llmgw`: the `llmgw` command."""

from llmgw.cli import main

raise SystemExit(main())
