"""Tests of the lease and the campaign for it."""
