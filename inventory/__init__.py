"""Inventory: GPU nodes, their GPUs and credentials, and the agent WebSocket."""
