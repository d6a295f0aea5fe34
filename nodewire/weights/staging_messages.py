"""The agent protocol's staging messages (re-exported by nodewire/protocol.py, where both ends import them).

control plane → agent, stamped and fenced like every command and acknowledged with `ack` at once:
  stage_weights   epoch, cid, source, revision: put the source's weights on the node's disk before any
                  engine needs them (agent/weights/staging.py): a hub id is fetched into the weights root
                  (resumable, every file checked against its published digest); an absolute path is only
                  checked. A repeat for a source already staging is acknowledged and changes nothing.

agent → control plane:
  staging_status  source, revision, state (fetching|ready|failed), bytes_done, bytes_total, bytes_per_second,
                  message, path (where the weights are, once ready): sent when the state changes and about
                  once a second while fetching. An agent that restarted reports nothing of a stage it
                  no longer runs: the control plane asks for it again once it has been quiet too long.
"""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from nodewire.parts import CommandId, _Message

STAGE_WEIGHTS = "stage_weights"
STAGING_STATUS = "staging_status"

StagingState = Literal["fetching", "ready", "failed"]
Source = Annotated[str, Meta(min_length=1, max_length=500)]
# A branch, a tag or a commit: what the hub's own client accepts.
Revision = Annotated[str, Meta(min_length=1, max_length=200)]
DEFAULT_REVISION = "main"


class StageWeights(_Message, frozen=True, kw_only=True, tag=STAGE_WEIGHTS):
    """Fetch (a hub id) or check (an absolute path) a source's weights on the node; holds no GPU."""

    epoch: int
    cid: CommandId = ""
    source: Source
    revision: Revision = DEFAULT_REVISION


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
