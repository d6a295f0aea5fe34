"""The `agent` management command."""
