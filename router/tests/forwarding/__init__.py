"""Tests of router.forwarding."""
