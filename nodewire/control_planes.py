"""The control-plane addresses an agent is given: the `--control-plane` option and the rule each meets.

`python -m agent`, the agent's link and `enrol_node --print-command` (which prints an agent command
line) share them, so an address one of them accepts the others accept too.
"""

from __future__ import annotations

import argparse
import re

CONTROL_PLANE_URL = re.compile(r"^wss?://[^/\s]+")


def add_control_plane_option(parser: argparse.ArgumentParser, help: str) -> None:
    """`--control-plane URL`, repeatable, collected in order into `control_planes`."""
    parser.add_argument("--control-plane", action="append", dest="control_planes", default=[], metavar="URL", help=help)


def address_problem(uri: object) -> str | None:
    """Why `uri` is not a control-plane address, as a sentence without its full stop; None when it is one."""
    if not isinstance(uri, str) or not CONTROL_PLANE_URL.match(uri):
        return f"control-plane address {uri!r} must be a ws:// or wss:// URL"
    return None
