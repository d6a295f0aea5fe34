"""This node's GPUs: discovery at start-up and live health before every heartbeat."""
