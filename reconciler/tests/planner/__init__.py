"""Tests of the what-if planner."""
