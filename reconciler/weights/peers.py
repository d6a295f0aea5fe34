"""Who a stage copies from: the hub once per cluster, then peer nodes, no node serving more than K copies at once.

When placement asks a node to stage a source (reconciler.weights.staging), the
node is given peers to copy from: nodes that hold the source (reported, or a
ready stage) or are fetching it themselves (the copier follows them file by
file, agent/weights/origins.py), whose agents run a weights server (their
hello's `weights_port`). The least busy first, at most two, and none already
serving LLMGW_STAGE_PEER_COPIES stages under way: when every candidate is that
busy the stage waits for one (the hub is not asked for what the fleet holds).
With no candidate at all, the node fetches from the hub itself, and the next
node wanting the source copies from it.

Each copy is allowed on the serving node with `serve_weights` and a ticket made
here; the copier presents that ticket. Both travel over the agents' own
authenticated links, so no new secret is distributed.
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from django.conf import settings

from inventory.choices import STAGING_UNDER_WAY, NodeState
from inventory.models import Node, WeightsStage
from nodewire.weights.staging_messages import StagePeer

PEERS_PER_STAGE = 2
TICKET_SECONDS = 86400.0


@dataclass(frozen=True)
class WeightsServer:
    """A node whose agent serves its weights to peers, and where."""

    node: str
    url: str


def server_url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}"


class PeerChoice:
    """The weights servers of the fleet and how many copies each serves now; picks a stage's peers."""

    def __init__(self, servers: dict[str, WeightsServer], serving: Iterable[str]):
        self.servers = servers
        self.load: Counter[str] = Counter(serving)  # node -> stages under way copying from it

    def peers_for(self, node: str, holders: Iterable[str], fetching: Iterable[str] = ()) -> list[StagePeer] | None:
        """Peers for `node`: nodes holding the weights first, then nodes fetching them (followed file by file),
        the least busy first within each. [] when there is none (the hub); None when there are some but every
        one already serves LLMGW_STAGE_PEER_COPIES (wait for one)."""
        held = [self.servers[c] for c in dict.fromkeys(holders) if c != node and c in self.servers]
        followed = [self.servers[c] for c in dict.fromkeys(fetching) if c != node and c in self.servers]
        followed = [s for s in followed if s not in held]
        if not held and not followed:
            return []
        limit = settings.LLMGW_STAGE_PEER_COPIES
        free = [
            s for group in (held, followed) for s in sorted(group, key=lambda s: self.load[s.node])
            if self.load[s.node] < limit
        ]  # fmt: skip
        if not free:
            return None
        chosen = free[:PEERS_PER_STAGE]
        for server in chosen:
            self.load[server.node] += 1
        return self.again([s.node for s in chosen])

    def again(self, names: Iterable[str]) -> list[StagePeer]:
        """Fresh tickets for the peers `names` that still serve (a stage asked for again keeps its peers)."""
        return [
            StagePeer(node=self.servers[n].node, url=self.servers[n].url, ticket=secrets.token_urlsafe(24))
            for n in names
            if n in self.servers
        ]

    @classmethod
    def read(cls) -> tuple[PeerChoice, frozenset[str]]:
        """The fleet's weights servers with the copies each feeds now (whatever the source), and the nodes able
        to stage at all (a weights root); two queries."""
        rows = Node.objects.filter(stages_weights=True, state=NodeState.READY).values_list(
            "name", "address", "reported_address", "weights_port"
        )
        servers = {
            name: WeightsServer(name, server_url(address or reported or name, port))
            for name, address, reported, port in rows
            if port is not None
        }
        under_way = (
            WeightsStage.objects.filter(state__in=STAGING_UNDER_WAY).exclude(peers=[]).values_list("peers", flat=True)
        )
        serving = (node for peers in under_way for node in peers)
        return cls(servers, serving), frozenset(name for name, *_ in rows)
