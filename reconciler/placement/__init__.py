"""Placement: where pending replicas go, what room eviction makes, and the capacity both read."""
