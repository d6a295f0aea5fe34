"""The WebSocket consumer that node agents connect to at /agent/ws.

Thin: it authenticates the node (DESIGN invariant 8), validates each message
with agent.protocol, hands it to one service function, and relays commands
that arrive on the node's channel-layer group (invariant 9).
"""

import json
import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings

from agent import protocol
from inventory.models import NodeCredential
from reconciler.outbox import node_group

from . import services
from .tls import client_common_name, has_tls_extension

log = logging.getLogger(__name__)


def _credentials(scope) -> tuple[str, str]:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    auth = headers.get("authorization", "")
    token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    return headers.get("x-llmgw-node", "").strip(), token


class AgentConsumer(AsyncWebsocketConsumer):
    """One node agent's stream."""

    node_name = None

    async def connect(self):
        name, token = _credentials(self.scope)
        cred = await database_sync_to_async(NodeCredential.objects.verify)(name, token) if name and token else None
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
            await self.channel_layer.group_discard(self.group, self.channel_name)
            log.info("agent disconnected: %s (code %s)", self.node_name, code)

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
                await database_sync_to_async(services.on_hello)(self.node_id, message)
            case protocol.Heartbeat():
                # Join the node's group again: a Redis restarted empty forgot it, and commands sent
                # to the group would reach nobody until the agent reconnected. Idempotent, one write.
                await self.channel_layer.group_add(self.group, self.channel_name)
                await database_sync_to_async(services.on_heartbeat)(self.node_id, self.node_name, message)
            case protocol.ShardStatus():
                await database_sync_to_async(services.on_shard_status)(self.node_id, message)
            case protocol.WeightsStatus():
                await database_sync_to_async(services.on_weights_status)(self.node_id, message)

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
