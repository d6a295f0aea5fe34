"""Tests of router.accounting."""
