"""The agent protocol's staging messages (re-exported by nodewire/protocol.py, where both ends import them).

control plane → agent, stamped and fenced like every command and acknowledged with `ack` at once:
  stage_weights   epoch, cid, source, revision, peers[{node, url, ticket}], evictable[{source, path}]
                  (what may go, least recently used first, if the node's weights budget needs room): put the
                  source's weights on the node's disk before any engine needs them
                  (agent/weights/staging.py): a hub id is copied
                  from the peers (nodes that hold it, or are fetching it), else fetched from the hub, into
                  the weights root (resumable, every file checked against its published digest); an
                  absolute path is only checked. A repeat for a source already staging changes nothing.
  serve_weights   epoch, cid, source, node, ticket, seconds: let `node` copy this node's weights of
                  `source` from its weights server (agent/weights/peer_server.py) with `ticket`, for
                  `seconds`.

agent → control plane:
  staging_status  source, revision, state (fetching|ready|failed), bytes_done, bytes_total, bytes_per_second,
                  message, path (where the weights are, once ready): sent when the state changes and about
                  once a second while fetching. An agent that restarted reports nothing of a stage it
                  no longer runs: the control plane asks for it again once it has been quiet too long.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta, Struct

from nodewire.parts import CommandId, _Message

STAGE_WEIGHTS = "stage_weights"
SERVE_WEIGHTS = "serve_weights"
STAGING_STATUS = "staging_status"

StagingState = Literal["fetching", "ready", "failed"]
Source = Annotated[str, Meta(min_length=1, max_length=500)]
# A branch, a tag or a commit: what the hub's own client accepts.
Revision = Annotated[str, Meta(min_length=1, max_length=200)]
DEFAULT_REVISION = "main"


# A secret the control plane makes for one copy; the serving agent accepts it only for what it was told.
Ticket = Annotated[str, Meta(min_length=16, max_length=128, pattern=r"^[A-Za-z0-9_-]+$")]


class StagePeer(Struct, frozen=True, kw_only=True):
    """A node to copy weights from: its weights server's URL and the ticket it was told to accept."""

    node: Annotated[str, Meta(min_length=1, max_length=63)]
    url: Annotated[str, Meta(min_length=1, max_length=300, pattern=r"^https?://")]
    ticket: Ticket


class Evictable(Struct, frozen=True, kw_only=True):
    """Weights on the node no engine there runs and nothing pins: removable to stay within its weights budget."""

    source: Source
    path: Annotated[str, Meta(min_length=1, max_length=4096)]


class StageWeights(_Message, frozen=True, kw_only=True, tag=STAGE_WEIGHTS):
    """Fetch (a hub id) or check (an absolute path) a source's weights on the node; holds no GPU.

    `evictable`: what the node may remove, least recently used first, when the new weights would not fit its
    weights budget (agent --weights-budget); anything else stays, and the stage fails saying why.
    """

    epoch: int
    cid: CommandId = ""
    source: Source
    revision: Revision = DEFAULT_REVISION
    peers: Annotated[list[StagePeer], Meta(max_length=8)] = []
    evictable: Annotated[list[Evictable], Meta(max_length=1000)] = []


class ServeWeights(_Message, frozen=True, kw_only=True, tag=SERVE_WEIGHTS):
    """Let another node copy this node's weights of `source`, with `ticket`, for `seconds`."""

    epoch: int
    cid: CommandId = ""
    source: Source
    node: Annotated[str, Meta(min_length=1, max_length=63)]
    ticket: Ticket
    seconds: Annotated[float, Meta(gt=0, le=7 * 86400)] = 86400.0


class StagingStatus(_Message, frozen=True, kw_only=True, tag=STAGING_STATUS):
    """Where one source's staging stands on the node."""

    source: Source
    revision: Revision = DEFAULT_REVISION
    state: StagingState
    bytes_done: Annotated[int, Meta(ge=0)] = 0
    bytes_total: Annotated[int, Meta(ge=0)] = 0
    bytes_per_second: Annotated[float, Meta(ge=0)] = 0.0
    message: Annotated[str, Meta(max_length=2000)] = ""
    path: Annotated[str, Meta(max_length=4096)] = ""
