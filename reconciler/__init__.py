"""Reconciler: replicas, shards, GPU assignments, the lease and the tick."""
