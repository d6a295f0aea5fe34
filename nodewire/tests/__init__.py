"""Tests of what both ends of the agent link share."""
