"""Commands to node agents: decided inside a transaction, sent only after it commits.

An agent never acts on a placement that was rolled back. Every command is
stamped with the lease epoch (DESIGN invariant 1): the tick's own, or — for
commands sent outside a tick (agent reports, admin actions) — the lease row's
current one. Delivery goes through the channel layer to the node's group, so
whichever control-plane process holds the node's stream relays it (invariant 9).

Every command carries a `cid` and is recorded as a PendingCommand in the same
transaction that decided it; the agent acknowledges it, and until then the tick
sends it again (reconciler/commands.py). So a message the channel layer drops,
or a node between connections, costs a resend, never the command. A full
channel is reported to the sender here (logged as an error), not dropped silently.
"""

from __future__ import annotations

import logging
import random
import secrets
from datetime import datetime, timedelta
from typing import Literal, cast

from asgiref.sync import async_to_sync
from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import transaction
from django.utils import timezone
from msgspec import structs

from hub.channel_layer import deliver_to_groups
from nodewire.adapter_messages import LoadAdapter, UnloadAdapter
from nodewire.protocol import (
    REMOVE_WEIGHTS,
    SERVE_WEIGHTS,
    STAGE_WEIGHTS,
    Command,
    DrainShard,
    RemoveWeights,
    ServeWeights,
    SleepShard,
    StageWeights,
    StartShard,
    StopShard,
    WakeShard,
    to_builtins,
)
from nodewire.weights.staging_messages import Evictable, StagePeer
from reconciler.models import Lease, PendingCommand

log = logging.getLogger(__name__)


def node_group(node_name: str) -> str:
    """The channel-layer group a node's agent stream joins."""
    return f"node.{node_name}"


def current_epoch() -> int:
    """The lease row's epoch (0 when nobody has ever led)."""
    return Lease.objects.filter(name=settings.LLMGW_LEASE_NAME).values_list("epoch", flat=True).first() or 0


def new_command_id() -> str:
    """A command id no other command has (the agent echoes it in its `ack`)."""
    return secrets.token_hex(8)


def resend_due(now: datetime, attempts: int) -> datetime:
    """When a command sent `attempts` times is sent again unless acknowledged: about
    LLMGW_COMMAND_RESEND_SECONDS, doubling per attempt up to 8 times that, with ±20% jitter so
    a burst dropped together is not re-sent together."""
    delay = settings.LLMGW_COMMAND_RESEND_SECONDS * min(2 ** max(attempts - 1, 0), 8)
    return now + timedelta(seconds=delay * random.uniform(0.8, 1.2))


def send_to_nodes(commands: list[tuple[str, dict]]) -> list[tuple[str, dict, Exception]]:
    """Deliver (node name, command as plain data) pairs in one trip to the event loop, however many there are.

    Returns the ones that could not be sent, with the error (ChannelFull when
    the stream's queue was full), so one unreachable channel layer shard does
    not stop the rest. A node with no stream now is not an error: the command
    waits, pending, for the agent to connect.
    """

    async def deliver():
        items = [(node_group(node), {"type": "agent.command", "command": cmd}) for node, cmd in commands]
        return await deliver_to_groups(get_channel_layer(), items)

    if not commands:
        return []
    failed: list[tuple[str, dict, Exception]] = []
    for (node_name, cmd), outcome in zip(commands, async_to_sync(deliver)(), strict=True):
        if outcome.full:
            failed.append((node_name, cmd, ChannelFull(f"{outcome.full} of {outcome.members} streams full")))
        elif not outcome.members:
            log.debug("node %s has no stream now; %s %s waits for it", node_name, cmd["type"], cmd.get("cid"))
    return failed


# The shard id node-level commands (remove_weights, stage_weights) are pending under: shard ids start at 1.
NODE_SHARD_ID = 0
WEIGHTS_SUBJECT_PREFIX = "weights:"
STAGE_SUBJECT_PREFIX = "stage:"


def weights_subject(source: str) -> str:
    """The subject a remove_weights for `source` is pending under (on shard NODE_SHARD_ID)."""
    return WEIGHTS_SUBJECT_PREFIX + source


def pending_key(cmd: dict) -> tuple[int, str]:
    """(shard id, subject) a command is pending under: its shard and, for an adapter command, the adapter's
    name; a remove_weights or a stage_weights is the node's, under its source, so it never replaces a shard's
    command (nor one the other)."""
    if cmd["type"] == REMOVE_WEIGHTS:
        return NODE_SHARD_ID, weights_subject(cmd["source"])
    if cmd["type"] == STAGE_WEIGHTS:
        return NODE_SHARD_ID, STAGE_SUBJECT_PREFIX + cmd["source"]
    if cmd["type"] == SERVE_WEIGHTS:
        return NODE_SHARD_ID, f"serve:{cmd['node']}:{cmd['source']}"
    return cmd["shard_id"], cmd.get("name", "")


def record_pending(built: list[tuple[str, dict]], now: datetime) -> None:
    """Record commands about to be sent as pending, each replacing any pending one under its key
    (`pending_key`: a newer command for the same shard, adapter or weights); one query."""
    rows: dict[tuple[str, int, str], PendingCommand] = {}
    for node, cmd in built:
        shard_id, subject = pending_key(cmd)
        rows[node, shard_id, subject] = PendingCommand(
            node_name=node,
            shard_id=shard_id,
            subject=subject,
            cid=cmd["cid"],
            kind=cmd["type"],
            payload=cmd,
            attempts=1,
            created_at=now,
            due_at=resend_due(now, 1),
        )
    PendingCommand.objects.bulk_create(
        list(rows.values()),
        update_conflicts=True,
        unique_fields=["node_name", "shard_id", "subject"],
        update_fields=["cid", "kind", "payload", "attempts", "created_at", "due_at"],
    )


_Command = Command  # every command the agent protocol defines (nodewire.protocol)


# The epoch and command id a command is built with until it is sent: `send_on_commit` stamps both.
UNSTAMPED = 0


class Outbox:
    """Agent commands decided inside a transaction, sent after it commits."""

    def __init__(self, epoch: int | None = None, now: datetime | None = None):
        self.epoch = epoch
        self.now = now  # when the commands are decided (the tick's clock); None: the wall clock
        self.commands: list[tuple[str, _Command]] = []  # (node name, command as yet unstamped)

    def start(self, node_name: str, command: StartShard) -> None:
        """Queue a start_shard, built unstamped (epoch `UNSTAMPED`, no command id)."""
        self.commands.append((node_name, command))

    def stop(self, node_name: str, shard_id: int) -> None:
        """Queue a stop_shard: the engine is stopped now, whatever it is doing."""
        self.commands.append((node_name, StopShard(epoch=UNSTAMPED, shard_id=shard_id)))

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
        self.commands.append(
            (node_name, DrainShard(epoch=UNSTAMPED, shard_id=shard_id, timeout_seconds=float(timeout_seconds)))
        )

    def sleep(self, node_name: str, shard_id: int, level: int, timeout_seconds: float) -> None:
        """Queue a sleep_shard: once the engine holds no requests (or after the timeout), it sleeps at `level`.

        Like a drain, send it only once the replica is out of the endpoint table.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        sleep = SleepShard(
            epoch=UNSTAMPED, shard_id=shard_id, level=cast(Literal[1, 2], level), timeout_seconds=float(timeout_seconds)
        )
        self.commands.append((node_name, sleep))

    def wake(self, node_name: str, shard_id: int) -> None:
        """Queue a wake_shard: the agent wakes the engine and reports the shard ready when it serves again."""
        self.commands.append((node_name, WakeShard(epoch=UNSTAMPED, shard_id=shard_id)))

    def remove_weights(self, node_name: str, source: str, path: str) -> None:
        """Queue a remove_weights: the agent deletes the weights at `path` (as it reported them) and answers."""
        self.commands.append((node_name, RemoveWeights(epoch=UNSTAMPED, source=source, path=path)))

    def stage_weights(
        self, node_name: str, source: str, revision: str, peers: list[StagePeer], evictable: list[Evictable]
    ) -> None:
        """Queue a stage_weights: the agent copies (from `peers`, else the hub) or checks the source's weights and
        reports as it goes, removing from `evictable` first if its weights budget needs room."""
        command = StageWeights(epoch=UNSTAMPED, source=source, revision=revision, peers=peers, evictable=evictable)
        self.commands.append((node_name, command))

    def serve_weights(self, node_name: str, source: str, copier: str, ticket: str, seconds: float) -> None:
        """Queue a serve_weights: the node's weights server lets `copier` copy the source with `ticket`."""
        command = ServeWeights(epoch=UNSTAMPED, source=source, node=copier, ticket=ticket, seconds=seconds)
        self.commands.append((node_name, command))

    def load_adapter(self, node_name: str, shard_id: int, name: str, source: str) -> None:
        """Queue a load_adapter: the agent loads the LoRA adapter into the shard's engine and reports the outcome."""
        self.commands.append((node_name, LoadAdapter(epoch=UNSTAMPED, shard_id=shard_id, name=name, source=source)))

    def unload_adapter(self, node_name: str, shard_id: int, name: str) -> None:
        """Queue an unload_adapter: the agent unloads the LoRA adapter from the shard's engine and reports it."""
        self.commands.append((node_name, UnloadAdapter(epoch=UNSTAMPED, shard_id=shard_id, name=name)))

    def send_on_commit(self) -> None:
        """Stamp the commands with the epoch and hand them to the channel layer once the transaction commits."""
        if not self.commands:
            return
        epoch = current_epoch() if self.epoch is None else self.epoch
        built = [
            (node, to_builtins(structs.replace(command, epoch=epoch, cid=new_command_id())))
            for node, command in self.commands
        ]
        record_pending(built, self.now or timezone.now())
        transaction.on_commit(lambda: deliver(built))


def deliver(commands: list[tuple[str, dict]]) -> None:
    """Send commands already recorded as pending; what fails is logged and stays pending, to be sent again."""
    try:
        failed = send_to_nodes(commands)
    except Exception:  # channel layer down: the commands stay pending and are sent again
        log.exception("could not send %d agent commands; they stay pending", len(commands))
        return
    for node_name, cmd, exc in failed:
        log.error(
            "could not send %s %s to node %s (%s): %s; it stays pending",
            cmd["type"], cmd["cid"], node_name, type(exc).__name__, exc,
        )  # fmt: skip
