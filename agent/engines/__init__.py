"""Engines as the agent drives them: the argv that starts each, and its control routes (sleep, adapters, load)."""
