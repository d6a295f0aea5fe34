"""Tests of the hibernate tier."""
