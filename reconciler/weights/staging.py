"""Staging in the tick: a replica whose weights its nodes lack waits for them without holding a GPU.

When placement (reconciler.placement.placer) puts a replica on nodes that do
not hold its weights, for an engine in LLMGW_STAGE_ENGINES (one that would
download a hub repository at start, holding its GPUs for as long), the replica
is not placed: its nodes are sent stage_weights (a hub repository is fetched,
from peers where the fleet holds it (reconciler.weights.peers); a path is only
checked there) (agent/weights/staging.py), one
`inventory.WeightsStage` row per node and source records where each stands,
and the replica stays PENDING with hold STAGING (routers hold its requests as
for any cold start). Its GPUs stay free for other models meanwhile. Each tick:

* a replica with a stage of its weights still under way (on a node that is
  ready), and no node holding them yet, waits: it is not offered to
  placement at all; once one node holds them it is offered (placement
  prefers that node, so the first replica starts while the others' nodes
  still copy);
* once none is under way it is placed as any pending replica, nodes holding
  the weights first, and a node whose stage is ready counts as holding them
  until its next weights report says so itself;
* a replica whose stage failed (and none other under way) fails, with the
  stage's words, and backs off like a replica whose engine failed: no engine
  ever starts on weights that did not verify;
* a stage the agent has not reported on for LLMGW_STAGE_STALL_SECONDS is
  asked for again: an agent that restarted resumes it from its partial files.

The weights of engines left out of LLMGW_STAGE_ENGINES are not staged (llama.cpp
reads its GGUF file where it is; the mock engine loads nothing, so only tests
and benches that stage put it there). A constant number of queries.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q

from catalog.engine_flags import pinned_revision
from catalog.models import Profile
from inventory.choices import STAGING_UNDER_WAY, NodeState, StagingState
from inventory.models import Node, WeightsStage
from nodewire.weights.disk import weights_key
from nodewire.weights.staging_messages import DEFAULT_REVISION, StagePeer
from reconciler.choices import Hold, ReplicaState
from reconciler.leadership.lease import Leadership
from reconciler.lifecycle.transitions import backoff_seconds
from reconciler.models import Replica
from reconciler.outbox import Outbox
from reconciler.weights.budget import evictable_on
from reconciler.weights.peers import TICKET_SECONDS, PeerChoice

log = logging.getLogger(__name__)


def stageable(profile: Profile) -> bool:
    """Whether a profile's weights are staged before its engine starts: those of an engine in LLMGW_STAGE_ENGINES
    (by default those that download a hub repository themselves: vLLM, SGLang). A hub repository is fetched; an
    absolute path (a local or shared filesystem) is only checked on the node, never copied."""
    return profile.engine in settings.LLMGW_STAGE_ENGINES


@dataclass(frozen=True)
class _Stage:
    node_name: str
    state: str
    node_ready: bool
    message: str


@dataclass
class Stages:
    """The stages of the weights keys placement deals with this tick, read once, and those it asks for."""

    by_key: dict[str, list[_Stage]] = field(default_factory=dict)
    _able: frozenset[str] | None = None  # nodes whose agents can stage (a weights root), read when first needed
    _peers: PeerChoice | None = None  # the fleet's weights servers, read with `_able`
    # (node, source, revision, peers) asked this tick
    asked: list[tuple[str, str, str, list[StagePeer]]] = field(default_factory=list)
    staged: list[Replica] = field(default_factory=list)  # replicas set to wait this tick

    @classmethod
    def of(cls, keys: set[str]) -> Stages:
        """One query."""
        by_key: dict[str, list[_Stage]] = defaultdict(list)
        rows = WeightsStage.objects.filter(source__in=keys).values_list(
            "source", "node__name", "state", "node__state", "message"
        )
        for source, node_name, state, node_state, message in rows:
            by_key[source].append(_Stage(node_name, state, node_state == NodeState.READY, message))
        return cls(dict(by_key))

    def under_way(self, key: str) -> bool:
        """Whether a stage of `key` is still fetching on a node that can finish it."""
        return any(s.state in STAGING_UNDER_WAY and s.node_ready for s in self.by_key.get(key, ()))

    def ready_on(self, key: str) -> frozenset[str]:
        """The nodes where a stage of `key` is ready (they hold the weights, whether reported yet or not)."""
        return frozenset(s.node_name for s in self.by_key.get(key, ()) if s.state == StagingState.READY)

    def failure(self, key: str) -> str:
        """Why the stages of `key` failed ("" when none did)."""
        failed = [s for s in self.by_key.get(key, ()) if s.state == StagingState.FAILED]
        return "; ".join(f"staging its weights on {s.node_name} failed: {s.message}" for s in failed)

    def sort_waiting(self, pending: list[Replica], now: datetime) -> list[Replica]:
        """The PENDING replicas to offer to placement now, in order: not those waiting for a stage; those
        whose stage failed fail (one UPDATE)."""
        offered, failed = [], []
        for replica in pending:
            key = key_of(replica.profile)
            if replica.hold != Hold.STAGING:
                offered.append(replica)
            elif self.under_way(key) and not self.ready_on(key):
                continue  # once a node holds them it is offered: placement prefers that node
            elif failure := self.failure(key):
                replica.last_error = failure
                failed.append(replica)
            else:
                offered.append(replica)
        if failed:
            _fail(failed, now)
        return offered

    def stage_instead(self, replica: Replica, nodes: list[str], holders: frozenset[str], outbox: Outbox) -> bool:
        """Whether `replica`, just placed on `nodes` in memory, must wait for staging instead. If so, the
        nodes lacking its weights are asked to stage them (unless already asked) and its note says so;
        `write` records both."""
        profile = replica.profile
        lacking = [n for n in nodes if n not in holders]
        if not lacking or not stageable(profile) or not self.able_to_stage().issuperset(lacking):
            return False
        waiting_for_peer = self.ask(key_of(profile), revision_of(profile), lacking, holders, outbox)
        replica.hold = Hold.STAGING
        replica.placement_note = f"staging its weights on {', '.join(lacking)}: no GPU is held until they are there"
        if waiting_for_peer:
            replica.placement_note += (
                f" ({', '.join(waiting_for_peer)} waits for a node holding them to be free to copy from)"
            )
        self.staged.append(replica)
        return True

    def ask(self, key: str, revision: str, lacking: list[str], holders: frozenset[str], outbox: Outbox) -> list[str]:
        """Ask the nodes `lacking` the weights of `key` (at `revision`) to stage them, unless already asked, each
        with peers to copy from (reconciler.weights.peers); returns the nodes that wait for a peer to be free."""
        under_way = [s.node_name for s in self.by_key.get(key, ()) if s.state in STAGING_UNDER_WAY and s.node_ready]
        fetching = under_way + [node for node, source, _, _ in self.asked if source == key]
        waiting_for_peer = []
        for node_name in lacking:
            if node_name in fetching:
                continue
            # Copy from those holding the weights, else follow those fetching them: the hub is asked once. A path
            # is checked where it is, not copied.
            path = os.path.isabs(key)
            peers = self.peer_choice().peers_for(node_name, [] if path else sorted(holders), [] if path else fetching)
            if peers is None:
                waiting_for_peer.append(node_name)
                continue
            for peer in peers:
                outbox.serve_weights(peer.node, key, node_name, peer.ticket, TICKET_SECONDS)
            self.asked.append((node_name, key, revision, peers))
            fetching.append(node_name)
        return waiting_for_peer

    def able_to_stage(self) -> frozenset[str]:
        """The nodes whose agents have a weights root to stage into (two queries, the first time, with their
        weights servers and what they serve). Elsewhere the engine downloads its weights itself, as it always could."""
        if self._able is None:
            self._peers, self._able = PeerChoice.read()
        return self._able

    def peer_choice(self) -> PeerChoice:
        self.able_to_stage()
        assert self._peers is not None
        return self._peers

    def write(self, now: datetime, outbox: Outbox) -> None:
        """The replicas set to wait (one UPDATE) and the stages asked for (one upsert, and their stage_weights with
        what each node may evict for them: reconciler.weights.budget), this tick."""
        if self.staged:
            Replica.objects.bulk_update(self.staged, ["hold", "placement_note", "profile"])
        if not self.asked:
            return
        evictable = evictable_on(node for node, *_ in self.asked)
        for node_name, source, revision, peers in self.asked:
            outbox.stage_weights(node_name, source, revision, peers, evictable.get(node_name, []))
        ids = dict(Node.objects.filter(name__in={n for n, *_ in self.asked}).values_list("name", "pk"))
        rows = [
            WeightsStage(
                node_id=ids[node_name], source=source, revision=revision, state=StagingState.ASKED,
                asked_at=now, updated_at=now, bytes_done=0, bytes_total=0, bytes_per_second=0.0, message="",
                peers=[p.node for p in peers],
            )
            for node_name, source, revision, peers in self.asked
            if node_name in ids
        ]  # fmt: skip
        WeightsStage.objects.bulk_create(
            rows,
            update_conflicts=True,
            unique_fields=["node", "source"],
            update_fields=[
                "revision", "state", "asked_at", "updated_at", "bytes_done", "bytes_per_second", "message", "peers"
            ],
        )  # fmt: skip
        log.info(
            "staging: asked %s",
            ", ".join(
                f"{node} for {source}@{revision} ({' '.join(p.node for p in peers) or 'from the hub'})"
                for node, source, revision, peers in self.asked
            ),
        )


def revision_of(profile: Profile) -> str:
    """The revision a profile's weights are staged at: the one its engine args pin (`--revision`), else the hub's
    default branch."""
    return pinned_revision(profile.engine, list(profile.engine_args or [])) or DEFAULT_REVISION


def key_of(profile: Profile) -> str:
    """The weights key a profile's stages are recorded under (nodewire.weights.disk.weights_key)."""
    return weights_key(profile.engine, profile.model.source)


def _fail(replicas: list[Replica], now: datetime) -> None:
    """Fail replicas whose weights could not be staged, with the backoff of a failed engine."""
    for replica in replicas:
        replica.state, replica.hold, replica.placement_note = ReplicaState.FAILED, Hold.NONE, ""
        replica.failure_count += 1
        replica.next_attempt_at = now + timedelta(seconds=backoff_seconds(replica.failure_count))
        log.warning("replica %s of %s failed: %s", replica.pk, replica.model.name, replica.last_error)
    fields = ["state", "hold", "placement_note", "failure_count", "next_attempt_at", "last_error"]
    Replica.objects.bulk_update(replicas, fields)


def stalls_due(leadership: Leadership, now: datetime) -> bool:
    """Whether this tick looks for stalled stages: every quarter of LLMGW_STAGE_STALL_SECONDS, so a steady tick
    pays no query for it."""
    due = leadership.next_stall_check is not None and now >= leadership.next_stall_check
    if leadership.next_stall_check is None or due:
        leadership.next_stall_check = now + timedelta(seconds=settings.LLMGW_STAGE_STALL_SECONDS / 4)
    return due


def resend_stalled(now: datetime, outbox: Outbox) -> int:
    """Ask again for stages their agents have not reported on for LLMGW_STAGE_STALL_SECONDS (one query when none
    is; then at most seven)."""
    cutoff = now - timedelta(seconds=settings.LLMGW_STAGE_STALL_SECONDS)
    stalled = list(
        WeightsStage.objects.filter(Q(updated_at__lt=cutoff), state__in=STAGING_UNDER_WAY, node__state=NodeState.READY)
        .values_list("pk", "node__name", "source", "revision", "peers")
        .order_by("pk")[:100]
    )
    choice = PeerChoice.read()[0] if any(peers for *_, peers in stalled) else None
    evictable = evictable_on(node_name for _, node_name, *_ in stalled)
    for _, node_name, source, revision, names in stalled:
        # The same peers, with new tickets: a server that restarted has forgotten the old ones.
        peers = choice.again(names) if choice is not None and names else []
        for peer in peers:
            outbox.serve_weights(peer.node, source, node_name, peer.ticket, TICKET_SECONDS)
        outbox.stage_weights(node_name, source, revision, peers, evictable.get(node_name, []))
    if stalled:
        WeightsStage.objects.filter(pk__in=[pk for pk, *_ in stalled]).update(asked_at=now, updated_at=now)
        log.info("staging: asked again for %d stage(s) their agents went quiet on", len(stalled))
    return len(stalled)
