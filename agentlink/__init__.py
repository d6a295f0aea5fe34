"""The agent link: node agents' WebSocket stream and what each of their messages changes.

It sits above `inventory` (nodes, GPUs) and `reconciler` (shards, replicas),
so neither imports the other; it owns nothing durable (DESIGN "Processes").
"""
