"""Tests of weights removal and the sweep."""
