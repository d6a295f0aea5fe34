"""Tests of the REST API under /api/v1."""
