"""The WebSocket consumer that node agents connect to at /agent/ws.

Thin: it authenticates the node (DESIGN invariant 8), validates each message
with nodewire.protocol, hands it to one service function, and relays commands
that arrive on the node's channel-layer group (invariant 9).

At fleet scale a steady heartbeat writes nothing: `last_seen` is batched
(agentlink.batches, as are acks and shard_status reports); a node running no
shard whose heartbeat is the same as its last costs no query at all (checked
against the tables every LLMGW_HEARTBEAT_RECHECK_SECONDS), and one running
shards costs reads only, so an orphan engine of a deleted shard is still
stopped at its next heartbeat.
"""

import asyncio
import json
import logging
import time

from channels.consumer import get_handler_name
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.db import connections

from agentlink import services
from agentlink.batches import acks, hellos, seen_nodes, shard_statuses
from agentlink.tls import client_common_name, has_tls_extension
from inventory.models import NodeCredential
from nodewire import adapter_messages, parts, protocol
from reconciler.outbox import node_group

log = logging.getLogger(__name__)

# Leaving the node's group is retried: a member left behind would be sent its node's commands
# until the group expiry (LLMGW_CHANNEL_GROUP_EXPIRY_SECONDS) drops it.
DISCARD_ATTEMPTS = 4
DISCARD_FIRST_DELAY_SECONDS = 0.2
# Heartbeats renew the stream's group membership this share of the group expiry apart.
GROUP_RENEW_FRACTION = 0.25


def in_database(fn):
    """`fn` as a coroutine run on a database thread.

    PostgreSQL takes concurrent transactions (it does from several control-plane
    processes anyway), so a burst of connects and hellos runs on the thread
    pool; SQLite has one writer, so there it keeps Django's one thread.
    """
    return database_sync_to_async(fn, thread_sensitive=connections["default"].vendor == "sqlite")


def _credentials(scope) -> tuple[str, str]:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    auth = headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    return headers.get("x-llmgw-node", "").strip(), token


class AgentConsumer(AsyncWebsocketConsumer):
    """One node agent's stream."""

    node_name = None
    # The last heartbeat checked against the tables, and when (time.monotonic()).
    last_heartbeat: protocol.Heartbeat | None = None
    heartbeat_checked_at = 0.0
    group_renewed_at = float("-inf")  # time.monotonic() of the last group_add

    async def dispatch(self, message):
        # channels hops to its one sync thread before every message to close stale database
        # connections; at a thousand streams that hop is the queue commands wait in. Every database
        # call here goes through database_sync_to_async, which closes them on its own thread.
        handler = getattr(self, get_handler_name(message), None)
        if handler is None:
            raise ValueError(f"no handler for message type {message['type']}")
        await handler(message)

    async def connect(self):
        name, token = _credentials(self.scope)
        cred = await in_database(NodeCredential.objects.verify)(name, token) if name and token else None
        if cred is None:
            log.warning("agent connection refused: bad or missing credential for node %r", name)
            # Closing before accept makes the handshake fail with HTTP 403.
            await self.close(code=protocol.CLOSE_UNAUTHORIZED)
            return
        refusal = self._certificate_refusal(name)
        if refusal:
            log.warning("agent connection refused: %s", refusal)
            await self.close(code=protocol.CLOSE_UNAUTHORIZED)
            return
        self.node_name, self.node_id = name, cred.node_id
        self.group = node_group(name)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        # A second connection for the same node replaces the first.
        await self.channel_layer.group_send(self.group, {"type": "agent.superseded", "by": self.channel_name})
        log.info("agent connected: %s", name)

    def _certificate_refusal(self, node: str) -> str | None:
        """With mutual TLS on, why this connection's certificate does not prove it is `node` (None if it does)."""
        if not settings.LLMGW_TLS_CLIENT_CA_FILE:
            return None
        if not has_tls_extension(self.scope):
            return (
                f"node “{node}” connected without TLS details (serve the control plane over TLS with "
                "--ws agentlink.tls:TLSWebSocketProtocol), so its certificate cannot be checked"
            )
        common_name = client_common_name(self.scope)
        if common_name is None:
            return f"node “{node}” presented no client certificate"
        if common_name != node:
            return f"certificate CN “{common_name}” does not match node “{node}” of the credential"
        return None

    async def disconnect(self, code):
        if self.node_name:
            await self._leave_group()
            log.info("agent disconnected: %s (code %s)", self.node_name, code)

    async def _leave_group(self) -> None:
        delay = DISCARD_FIRST_DELAY_SECONDS
        for attempt in range(1, DISCARD_ATTEMPTS + 1):
            try:
                await self.channel_layer.group_discard(self.group, self.channel_name)
                return
            except Exception as exc:
                if attempt == DISCARD_ATTEMPTS:
                    log.error(
                        "agent stream of %s could not leave its group (%s); the group expiry drops it",
                        self.node_name, exc,
                    )  # fmt: skip
                    return
                await asyncio.sleep(delay)
                delay *= 2

    async def receive(self, text_data=None, bytes_data=None):
        try:
            message = protocol.decode_agent_message(text_data if text_data is not None else bytes_data)
        except protocol.ProtocolError as exc:
            await self._error(str(exc))
            return
        match message:
            case protocol.Hello() if message.node != self.node_name:
                await self._error(f"hello names node “{message.node}” but this credential is for “{self.node_name}”")
            case protocol.Hello():
                self.last_heartbeat = None
                await hellos.submit((self.node_id, message))
                # The hello recorded what a heartbeat reports: a first heartbeat saying the same costs no query.
                self.last_heartbeat = protocol.Heartbeat(
                    gpus=[parts.GPUHealth(index=g.index, healthy=g.healthy, reason=g.reason) for g in message.gpus]
                )
                self.heartbeat_checked_at = time.monotonic()
            case protocol.Heartbeat():
                await self._renew_group()
                await self._heartbeat(message)
            case protocol.ShardStatus():
                # The next heartbeat is checked anyway if the node runs shards; a report changes no GPU's health.
                shard_statuses.add((self.node_id, self.node_name, message))
            case protocol.WeightsStatus():
                await in_database(services.on_weights_status)(self.node_id, message)
            case protocol.StagingStatus():
                await in_database(services.on_staging_status)(self.node_id, message)
            case adapter_messages.AdapterStatus():
                await in_database(services.on_adapter_status)(self.node_id, message)
            case protocol.Ack():
                if message.refused:
                    log.warning("node %s refused command %s: %s", self.node_name, message.cid, message.message)
                acks.add((self.node_name, message.cid))

    async def _renew_group(self) -> None:
        # Join the node's group again: a Redis restarted empty forgot it (commands sent meanwhile stay
        # pending and are re-sent), and the membership must be renewed within the group expiry. A
        # quarter of the expiry apart, not at every heartbeat: a write per beat is a write per node.
        now = time.monotonic()
        if now - self.group_renewed_at >= GROUP_RENEW_FRACTION * settings.LLMGW_CHANNEL_GROUP_EXPIRY_SECONDS:
            await self.channel_layer.group_add(self.group, self.channel_name)
            self.group_renewed_at = now

    async def _heartbeat(self, message: protocol.Heartbeat) -> None:
        batched = settings.LLMGW_LAST_SEEN_FLUSH_SECONDS > 0
        if batched:
            seen_nodes.add(self.node_id)
        now = time.monotonic()
        # Only a node running no shard skips the check: one that runs some must hear at once when a
        # shard's row is gone (its engine is an orphan holding GPUs), and reading its rows writes nothing.
        unchanged = message == self.last_heartbeat and not message.shards
        if unchanged and now - self.heartbeat_checked_at < settings.LLMGW_HEARTBEAT_RECHECK_SECONDS:
            if not batched:
                await in_database(services.on_heartbeat)(self.node_id, self.node_name, message)
            return
        await in_database(services.on_heartbeat)(self.node_id, self.node_name, message, not batched)
        self.last_heartbeat, self.heartbeat_checked_at = message, now

    async def _error(self, text: str) -> None:
        await self.send(text_data=protocol.encode(protocol.Error(message=text)).decode())

    # -- channel-layer events ------------------------------------------------
    async def agent_command(self, event):
        # Built and checked by reconciler.outbox; it travels the channel layer as plain data.
        await self.send(text_data=json.dumps(event["command"]))

    async def agent_superseded(self, event):
        if event["by"] != self.channel_name:
            log.info("agent stream for %s replaced by a newer connection", self.node_name)
            await self.close(code=protocol.CLOSE_SUPERSEDED)
