"""Picking a replica: the picker over the route table, the choice among replicas, outlier ejection, prefix affinity and engines' own load."""
