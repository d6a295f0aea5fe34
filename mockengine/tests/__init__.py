"""Tests of the bundled mock engine, run as a real process."""
