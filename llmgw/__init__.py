"""llmgw: run LLM inference engines on a GPU fleet behind one OpenAI-compatible endpoint.

This package holds the `llmgw` command (llmgw.cli); the apps are the project's other top-level packages.
"""

__version__ = "0.1.0"
