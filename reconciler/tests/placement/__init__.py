"""Tests of placement, the eviction order and making room."""
