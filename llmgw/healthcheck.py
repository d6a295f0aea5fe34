"""`python -m llmgw.healthcheck`: the container image's HEALTHCHECK, one for every role the image runs.

The image is the same for every role; the command it was started with says which (`llmgw server`, `llmgw
router`, `llmgw up`, …), so this reads PID 1's command line and probes what that role serves: `/healthz` on
the port it listens on (its `--port`, else the role's default, else LLMGW_PORT for `up`). A worker, beat or
agent serves no HTTP: it is healthy while it runs, which the container runtime sees already. Exit 0 healthy,
1 not (Docker's and podman's convention).
"""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path

DEFAULT_PORTS = {"server": 8000, "router": 8080, "up": 8000}
TIMEOUT_SECONDS = 3.0


def role_and_port(argv: list[str]) -> tuple[str, int | None]:
    """The `llmgw` subcommand in `argv` (a process's command line) and the port it serves HTTP on (None: none)."""
    words = [Path(word).name for word in argv]
    role = next((argv[i + 1] for i, word in enumerate(words[:-1]) if word == "llmgw"), "")
    if role not in DEFAULT_PORTS:
        return role, None
    port = next((argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--port"), None)
    if port is None:
        port = next((word.split("=", 1)[1] for word in argv if word.startswith("--port=")), None)
    if port is None and role == "up":
        port = os.environ.get("LLMGW_PORT")
    return role, int(port) if port else DEFAULT_PORTS[role]


def main() -> int:
    argv = [word.decode() for word in Path("/proc/1/cmdline").read_bytes().split(b"\0") if word]
    role, port = role_and_port(argv)
    if port is None:
        return 0
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=TIMEOUT_SECONDS) as answer:
            return 0 if answer.status == 200 else 1
    except OSError as exc:
        print(f"llmgw {role} on port {port}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
