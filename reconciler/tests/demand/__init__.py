"""Tests of demand, usage and idleness."""
