"""The `llmgw` command: one entry point for every process and operator task.

Each subcommand is a Django management command of the project (its options,
its `--help`, its errors: a bad argument exits 2), run with the project's
settings, except `agent`, which runs the node agent without Django, so a GPU
node needs none of the control plane's server stack. Modules are named here
as strings and imported only for the subcommand asked for: `llmgw agent`
never imports Django, `llmgw --help` imports nothing.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass

from llmgw import __version__

SETTINGS = "llmgw_site.settings"
SERVER_EXTRA = "pip install 'llmgw[server]'"


@dataclass(frozen=True)
class Subcommand:
    """What `llmgw NAME` runs: a Django management command, or a `module:function` taking argv (no Django)."""

    summary: str
    django: str = ""
    entry: str = ""


# In the order `llmgw --help` lists them: processes first, then operator tasks.
SUBCOMMANDS = {
    "up": Subcommand("everything in one process: control plane, router, reconciler (--demo: a simulated fleet)", "up"),
    "server": Subcommand("the control plane's HTTP server: admin, REST API, agent link, metrics, probes", "server"),
    "router": Subcommand("a router: the OpenAI API in front of the replicas (or of engines given by hand)", "router"),
    "worker": Subcommand("a reconciler worker (Celery): runs the reconcile ticks while it holds the lease", "worker"),
    "beat": Subcommand("beat (Celery): sends the reconcile ticks", "beat"),
    "agent": Subcommand(
        "the node agent, on a GPU node: starts and stops engines (needs no server stack)", entry="agent.cli:main"
    ),
    "migrate": Subcommand("create or update the database's tables", "migrate"),
    "createsuperuser": Subcommand("create an operator account for the admin and the API", "createsuperuser"),
    "status": Subcommand("the fleet at a glance: nodes, GPUs, models, replicas, what can be stopped", "ctl_status"),
    "plan": Subcommand("what if: where a model would go, what it would evict, without changing anything", "plan"),
    "catalog": Subcommand("the catalog as code: apply or export models, aliases, profiles and adapters", "catalog"),
    "keys": Subcommand("the router's API keys: create, revoke, list", "keys"),
    "showback": Subcommand("each team's share of a month's GPU-hours (--csv for a chargeback sheet)", "showback"),
    "enrol": Subcommand("enrol a node and print its credential (or its agent's whole command line)", "enrol_node"),
    "manage": Subcommand("any other management command of the project (`llmgw manage help` lists them)"),
}


def parser() -> argparse.ArgumentParser:
    """`llmgw`'s own parser: its subcommands' arguments are theirs to parse."""
    top = argparse.ArgumentParser(
        prog="llmgw",
        description="Run LLM inference engines on a GPU fleet behind one OpenAI-compatible endpoint.",
        epilog="`llmgw COMMAND --help` shows a command's options. State goes to LLMGW_HOME; settings come from the "
        "environment (DATABASE_URL, REDIS_URL, SECRET_KEY, …).",
    )
    top.add_argument("--version", action="version", version=f"llmgw {__version__}")
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, subcommand in SUBCOMMANDS.items():
        # No options of its own: everything after the name goes to the command, --help included.
        commands.add_parser(name, help=subcommand.summary, add_help=False)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run `llmgw ARGV`; return its exit code (2: a bad command line)."""
    argv = sys.argv[1:] if argv is None else argv
    # Only the name is parsed here (and --help, --version); the rest is the subcommand's own.
    parser().parse_args(argv[:1])
    name, rest = argv[0], argv[1:]
    subcommand = SUBCOMMANDS[name]
    if subcommand.entry:
        module, _, function = subcommand.entry.partition(":")
        result: int = getattr(importlib.import_module(module), function)(rest, prog=f"llmgw {name}")
        return result
    if not subcommand.django:  # `manage`: the command is the next word
        if not rest or rest[0].startswith("-"):
            rest = ["help", *rest]
        return run_django(rest[0], rest[1:], f"manage {rest[0]}")
    return run_django(subcommand.django, rest, name)


def run_django(command: str, rest: list[str], name: str) -> int:
    """Run the project's management command `command` with `rest` as `llmgw NAME`: Django's own way
    (BaseCommand.run_from_argv), but a refusal (CommandError) is a bad command line too, so it exits 2."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", SETTINGS)
    prog = f"llmgw {name}"
    try:
        django = importlib.import_module("django")
    except ModuleNotFoundError:
        print(f"{prog}: the control plane's server stack is not installed here ({SERVER_EXTRA})", file=sys.stderr)
        return 2
    django.setup()
    management = importlib.import_module("django.core.management")
    if command == "help":
        management.ManagementUtility(["llmgw manage", "help", *rest]).execute()
        return 0
    apps = management.get_commands()
    if command not in apps:
        print(f"{prog}: error: no such command (`llmgw manage help` lists them)", file=sys.stderr)
        return 2
    handler = management.load_command_class(apps[command], command)
    handler._called_from_command_line = True  # as run_from_argv sets it: argparse errors exit 2 with the usage
    options = handler.create_parser("llmgw", name).parse_args(rest)  # argparse: a usage error exits 2
    arguments = vars(options)
    positional = arguments.pop("args", ())
    management.base.handle_default_options(options)
    try:
        handler.execute(*positional, **arguments)
    except management.CommandError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0
