"""Sending commands to node agents through the channel layer (DESIGN invariant 9).

Whichever control-plane process holds a node's WebSocket has joined the group
`node.<name>`, so the leader can command any node without holding its stream.
"""

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer


def node_group(node_name: str) -> str:
    return f"node.{node_name}"


def send_to_node(node_name: str, command: dict) -> None:
    """Deliver `command` (built with agent.protocol.command) to the node's agent."""
    async_to_sync(get_channel_layer().group_send)(node_group(node_name), {"type": "agent.command", "command": command})
