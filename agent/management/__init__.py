"""Management commands of the agent app."""
