"""Tests of router.endpoints."""
