"""Tests of router.picking."""
