"""REST API under /api/v1/: the cluster summary and read-only catalog, inventory and replica lists."""
