"""Sending commands to node agents through the channel layer (DESIGN invariant 9).

Whichever control-plane process holds a node's WebSocket has joined the group
`node.<name>`, so the leader can command any node without holding its stream.
"""

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer


def node_group(node_name: str) -> str:
    return f"node.{node_name}"


def send_to_nodes(commands: list[tuple[str, dict]]) -> list[tuple[str, dict, Exception]]:
    """Deliver (node name, command) pairs, commands built with agent.protocol.command.

    All in one trip to the event loop, however many there are.

    Returns the ones that could not be sent, with the error, so one unreachable
    channel layer shard does not stop the rest.
    """

    async def deliver():
        layer, failed = get_channel_layer(), []
        for node_name, command in commands:
            try:
                await layer.group_send(node_group(node_name), {"type": "agent.command", "command": command})
            except Exception as exc:  # reported to the caller, which decides what covers it
                failed.append((node_name, command, exc))
        return failed

    return async_to_sync(deliver)() if commands else []
