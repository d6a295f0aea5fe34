"""Picking a replica: the balancer over the endpoint table, the choice among replicas, outlier ejection, prefix affinity and engines' own load."""
