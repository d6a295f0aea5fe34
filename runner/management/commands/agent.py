"""`manage.py agent`: the node agent, for a checkout that has the control plane.

A thin wrapper over agent/cli.py, which GPU nodes run as `python -m agent`
without Django; the only difference is the heartbeat default, taken here from
the settings.
"""

import asyncio

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from agent import cli
from agent.link import AgentRejected


class Command(BaseCommand):
    """Thin over agent.cli: build the agent from the parsed options, run it until a signal stops it."""

    help = "Run the node agent: connect to the control plane and start or stop engine shards on this node's GPUs."

    def add_arguments(self, parser):
        cli.add_arguments(parser)

    def handle(self, *args, **options):
        try:
            agent = cli.agent_from_options(options, settings.LLMGW_HEARTBEAT_SECONDS)
        except cli.UsageError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(cli.describe(agent))
        try:
            asyncio.run(cli.run_until_signalled(agent))
        except AgentRejected as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(self.style.SUCCESS(f"agent for node {agent.node} stopped"))
