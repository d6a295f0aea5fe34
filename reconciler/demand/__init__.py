"""Demand: how many replicas each model wants, from activations, load, idleness and usage."""
