"""Commands to node agents: decided inside a transaction, sent only after it commits.

An agent never acts on a placement that was rolled back. Every command is
stamped with the lease epoch (DESIGN invariant 1): the tick's own, or — for
commands sent outside a tick (agent reports, admin actions) — the lease row's
current one. Delivery goes through the channel layer to the node's group, so
whichever control-plane process holds the node's stream relays it (invariant 9).
"""

from __future__ import annotations

import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction

from agent.protocol import DrainShard, RemoveWeights, StartShard, StopShard, to_builtins

from .models import Lease

log = logging.getLogger(__name__)


def node_group(node_name: str) -> str:
    """The channel-layer group a node's agent stream joins."""
    return f"node.{node_name}"


def current_epoch() -> int:
    """The lease row's epoch (0 when nobody has ever led)."""
    return Lease.objects.filter(name=settings.LLMGW_LEASE_NAME).values_list("epoch", flat=True).first() or 0


def send_to_nodes(commands: list[tuple[str, dict]]) -> list[tuple[str, dict, Exception]]:
    """Deliver (node name, command as plain data) pairs in one trip to the event loop, however many there are.

    Returns the ones that could not be sent, with the error, so one unreachable
    channel layer shard does not stop the rest.
    """

    async def deliver():
        layer, failed = get_channel_layer(), []
        for node_name, cmd in commands:
            try:
                await layer.group_send(node_group(node_name), {"type": "agent.command", "command": cmd})
            except Exception as exc:  # reported to the caller, which decides what covers it
                failed.append((node_name, cmd, exc))
        return failed

    return async_to_sync(deliver)() if commands else []


class Outbox:
    """Agent commands decided inside a transaction, sent after it commits."""

    def __init__(self, epoch: int | None = None):
        self.epoch = epoch
        self.commands: list[tuple[str, type[StartShard | StopShard | DrainShard | RemoveWeights], dict]] = []

    def start(self, node_name: str, **fields) -> None:
        """Queue a start_shard; `fields` are StartShard's fields but the epoch."""
        self.commands.append((node_name, StartShard, fields))

    def stop(self, node_name: str, shard_id: int) -> None:
        """Queue a stop_shard: the engine is stopped now, whatever it is doing."""
        self.commands.append((node_name, StopShard, {"shard_id": shard_id}))

    def drain(self, node_name: str, shard_id: int, timeout_seconds: float) -> None:
        """Queue a drain_shard: the agent stops the engine once it holds no requests, or after the timeout.

        Send it only once the replica is out of the endpoint table, or new
        requests keep the engine busy until the timeout.
        """
        if (
            isinstance(timeout_seconds, bool)
            or not isinstance(timeout_seconds, int | float)
            or not timeout_seconds >= 0
        ):
            raise ValueError(f"drain timeout must be a number of seconds >= 0, got {timeout_seconds!r}")
        self.commands.append((node_name, DrainShard, {"shard_id": shard_id, "timeout_seconds": float(timeout_seconds)}))

    def remove_weights(self, node_name: str, source: str, path: str) -> None:
        """Queue a remove_weights: the agent deletes the weights at `path` (as it reported them) and answers."""
        self.commands.append((node_name, RemoveWeights, {"source": source, "path": path}))

    def send_on_commit(self) -> None:
        """Stamp the commands with the epoch and hand them to the channel layer once the transaction commits."""
        if not self.commands:
            return
        epoch = current_epoch() if self.epoch is None else self.epoch
        built = [(node, to_builtins(kind(epoch=epoch, **fields))) for node, kind, fields in self.commands]
        transaction.on_commit(lambda: _deliver(built))


def _deliver(commands: list[tuple[str, dict]]) -> None:
    try:
        failed = send_to_nodes(commands)
    except Exception:  # channel layer down: resends (starts) and the next tick (stops) cover it
        log.exception("could not send %d agent commands", len(commands))
        return
    for node_name, cmd, exc in failed:
        log.error("could not send %s to node %s: %s", cmd["type"], node_name, exc)
