"""`manage.py enrol_node NAME [--address A] [--fabric F] [--print-command [--control-plane URL ...] [--ca-file P]]`.

Creates a node and prints its agent token once; with `--print-command`, a
ready-to-run agent command line instead (node, token, control-plane URLs,
and `--ca-file` for wss:// addresses), shell-quoted so it can be pasted.
"""

import shlex

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from inventory.services import EnrolmentError, enrol_node
from nodewire.control_planes import add_control_plane_option, address_problem


def _sentence(error: ValidationError) -> str:
    if hasattr(error, "error_dict"):
        return "; ".join(f"{field}: {' '.join(msgs)}" for field, msgs in error.message_dict.items())
    return " ".join(error.messages)


def agent_command(
    name: str, token: str, control_planes: list[str], *, address: str = "", fabric: str = "", ca_file: str = ""
) -> str:
    """The shell command that runs this node's agent; `--ca-file` only where it applies (wss://)."""
    argv = ["python", "-m", "agent"]
    for url in control_planes:
        argv += ["--control-plane", url]
    argv += ["--node", name, "--token", token]
    if fabric:
        argv += ["--fabric", fabric]
    if address:
        argv += ["--address", address]
    if ca_file and any(url.startswith("wss://") for url in control_planes):
        argv += ["--ca-file", ca_file]
    return shlex.join(argv)


class Command(BaseCommand):
    help = "Enrol a GPU node: create it with a fresh credential and print the token its agent needs (shown once)."

    def add_arguments(self, parser):
        parser.add_argument("name", help="The node's name, as its agent will report it.")
        parser.add_argument("--address", default="", help="Host or IP engines on this node are reached on.")
        parser.add_argument("--fabric", default="", help="Interconnect domain, e.g. an InfiniBand fabric name.")
        parser.add_argument(
            "--print-command",
            action="store_true",
            help="Print the whole agent command line (with the token) instead of the token alone.",
        )
        add_control_plane_option(
            parser,
            help="With --print-command: an /agent/ws URL for the agent; repeat for several "
            "(default: LLMGW_AGENT_CONTROL_PLANES).",
        )
        parser.add_argument(
            "--ca-file",
            default=None,
            help="With --print-command: the CA bundle path on the node, for wss:// (default: LLMGW_AGENT_CA_FILE).",
        )

    def handle(self, *args, name, address, fabric, print_command, control_planes, ca_file, **options):
        if (control_planes or ca_file) and not print_command:
            raise CommandError("--control-plane and --ca-file go with --print-command")
        if print_command:
            control_planes = control_planes or list(settings.LLMGW_AGENT_CONTROL_PLANES)
            if not control_planes:
                raise CommandError(
                    "--print-command needs the control plane's address: give --control-plane "
                    "wss://HOST:PORT/agent/ws or set LLMGW_AGENT_CONTROL_PLANES"
                )
            problem = next(filter(None, map(address_problem, control_planes)), None)
            if problem is not None:
                raise CommandError(problem)
            ca_file = ca_file if ca_file is not None else settings.LLMGW_AGENT_CA_FILE
        try:
            node, token = enrol_node(name, address=address, fabric=fabric)
        except EnrolmentError as exc:
            raise CommandError(str(exc)) from None
        except ValidationError as exc:
            raise CommandError(f"cannot enrol node “{name}”: {_sentence(exc)}") from None
        if print_command:
            self.stdout.write(
                agent_command(node.name, token, control_planes, address=address, fabric=fabric, ca_file=ca_file or "")
            )
            if settings.LLMGW_TLS_CLIENT_CA_FILE:
                self.stderr.write(
                    self.style.WARNING(
                        f"Mutual TLS is on: also give the agent --cert-file and --key-file, a certificate "
                        f"from the client CA whose CN is “{node.name}”."
                    )
                )
        else:
            # The token alone on stdout, so scripts can capture it.
            self.stdout.write(token)
        self.stderr.write(
            self.style.WARNING(
                f"Enrolled node “{node.name}”. Give this token to its agent; it will not be shown again."
            )
        )
