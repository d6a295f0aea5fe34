"""REST API under /api/v1/ (staff only): the cluster summary; models, nodes, replicas and API keys, read and changed."""
