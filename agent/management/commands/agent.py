"""`manage.py agent`: run this machine's node agent until Ctrl-C or SIGTERM.

    manage.py agent --control-plane ws://cp1:8000/agent/ws --control-plane ws://cp2:8000/agent/ws \
        --node gpu-07 --token "$LLMGW_NODE_TOKEN" [--fake-gpus 8xH100-80GB] [--fabric ib-a] \
        [--address 10.0.0.7] [--label rack=r3 ...] [--heartbeat-seconds 5]
"""

import asyncio
import os
import re
import signal
import socket

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from agent.gpus import GPUDiscoveryError, discover_gpus
from agent.runtime import Agent, AgentRejected

# The same rule as inventory's node names: they become channel-layer group names.
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


def parse_labels(items: list[str]) -> dict[str, str]:
    """`k=v` strings to a dict; CommandError names the first bad one."""
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not LABEL_KEY.match(key):
            raise CommandError(f"Label {item!r} is not key=value with a key of letters, digits and . _ / -.")
        labels[key] = value
    return labels


class Command(BaseCommand):
    help = "Run the node agent: connect to the control plane and start or stop engine shards on this node's GPUs."

    def add_arguments(self, parser):
        parser.add_argument(
            "--control-plane",
            action="append",
            dest="control_planes",
            default=[],
            metavar="URL",
            help="ws:// or wss:// address of /agent/ws; repeat for several control-plane processes",
        )
        parser.add_argument("--node", required=True, help="this node's enrolled name")
        parser.add_argument("--token", default=None, help="the node credential (default: $LLMGW_NODE_TOKEN)")
        parser.add_argument("--fake-gpus", default=None, help="simulate GPUs, e.g. 8xH100-80GB or 4xL40S-48GB,2xA100-40GB")
        parser.add_argument("--fabric", default="", help="interconnect domain of this node, e.g. ib-a")
        parser.add_argument("--address", default=None, help="host or IP engines are reached on (default: this host's)")
        parser.add_argument("--label", action="append", dest="labels", default=[], metavar="KEY=VALUE")
        parser.add_argument(
            "--heartbeat-seconds", type=float, default=None, help="seconds between heartbeats (default from settings)"
        )

    def handle(self, *args, **options):
        control_planes = options["control_planes"]
        if not control_planes:
            raise CommandError("Give at least one --control-plane ws://HOST:PORT/agent/ws address.")
        for uri in control_planes:
            if not re.match(r"^wss?://[^/\s]+", uri):
                raise CommandError(f"Control-plane address {uri!r} must be a ws:// or wss:// URL.")
        node = options["node"]
        if not NODE_NAME.match(node):
            raise CommandError(f"Node name {node!r} must be letters, digits and . _ - (at most 63 characters).")
        token = options["token"] or os.environ.get("LLMGW_NODE_TOKEN", "")
        if not token:
            raise CommandError("Give the node credential with --token or the LLMGW_NODE_TOKEN environment variable.")
        heartbeat = options["heartbeat_seconds"]
        if heartbeat is None:
            heartbeat = settings.LLMGW_HEARTBEAT_SECONDS
        if not heartbeat > 0:
            raise CommandError(f"--heartbeat-seconds must be positive, got {heartbeat}.")
        labels = parse_labels(options["labels"])
        try:
            gpus = discover_gpus(options["fake_gpus"], node)
        except (ValueError, GPUDiscoveryError) as exc:
            raise CommandError(f"Cannot discover GPUs: {exc}.") from None
        address = options["address"] or socket.getfqdn()

        agent = Agent(
            control_planes,
            node,
            token,
            gpus,
            address=address,
            fabric=options["fabric"],
            labels=labels,
            heartbeat_seconds=heartbeat,
        )
        self.stdout.write(f"agent for node {node}: {len(gpus)} GPU(s), control plane {', '.join(control_planes)}")
        try:
            asyncio.run(self._run(agent))
        except AgentRejected as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(self.style.SUCCESS(f"agent for node {node} stopped"))

    async def _run(self, agent: Agent) -> None:
        loop = asyncio.get_running_loop()
        pending = []

        def on_signal():
            # Signal handlers cannot await; the shutdown runs as a task and run() returns after it.
            pending.append(asyncio.ensure_future(agent.shutdown()))

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            await agent.run()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            await asyncio.gather(*pending, return_exceptions=True)
