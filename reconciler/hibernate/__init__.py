"""The hibernate tier: sleeping replicas, swaps, and the host memory sleepers hold."""
