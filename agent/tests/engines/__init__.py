"""Tests of the engines as the agent drives them."""
