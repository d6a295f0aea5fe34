"""`python -m agent`: run this machine's node agent until Ctrl-C or SIGTERM, without Django.

    python -m agent --control-plane ws://cp1:8000/agent/ws --control-plane ws://cp2:8000/agent/ws \
        --node gpu-07 --token "$LLMGW_NODE_TOKEN" [--fake-gpus 8xH100-80GB] [--fabric ib-a] \
        [--address 10.0.0.7] [--label rack=r3 ...] [--heartbeat-seconds 5] [--llama-server PATH] \
        [--vllm-command 'vllm serve'] [--weights-root /data/models] [--weights-port 8479] [--weights-budget 2T] \
        [--state-dir /var/lib/llmgw-agent] [--ca-file ca.pem] [--cert-file node.pem --key-file node-key.pem]

A GPU node runs only this: it imports no Django and no control-plane settings,
so it creates no var/ folder and no secret key there. `manage.py agent` is a
thin wrapper over the same functions, for a checkout that has the control plane.
Bad input is one sentence naming the problem (UsageError) and a non-zero exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import shutil
import signal
import socket
import sys
from collections.abc import Mapping
from typing import Any, TypedDict

from agent.engines.launch import DEFAULT_LLAMA_SERVER
from agent.engines.vllm_command import VLLM_COMMAND_ENV, vllm_command_from
from agent.gpus.discovery import GPUDiscoveryError, GPUInfo, discover_gpus
from agent.gpus.health import HEALTHY, HealthReader, SimulatedHealth, hardware_reader
from agent.link import AgentRejected
from agent.options import AgentOptions
from agent.runtime import Agent
from agent.state import STATE_DIR_ENV, StateError, default_state_dir
from agent.weights.budget import parse_size
from nodewire.control_planes import add_control_plane_option, address_problem
from nodewire.protocol import NODE_NAME_PATTERN, parse_port

HEARTBEAT_ENV = "LLMGW_HEARTBEAT_SECONDS"
LLAMA_SERVER_ENV = "LLMGW_LLAMA_SERVER"
WEIGHTS_ROOT_ENV = "LLMGW_WEIGHTS_ROOT"
CA_FILE_ENV = "LLMGW_AGENT_CA_FILE"
CERT_FILE_ENV = "LLMGW_AGENT_CERT_FILE"
KEY_FILE_ENV = "LLMGW_AGENT_KEY_FILE"
DEFAULT_HEARTBEAT_SECONDS = 5.0
# The control plane's settings use the same floor for the same variable.
MIN_HEARTBEAT_SECONDS = 0.1
NODE_NAME = re.compile(NODE_NAME_PATTERN)
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


class UsageError(Exception):
    """Bad input to the agent command; the text is one sentence naming the problem."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's options, shared by `python -m agent` and `manage.py agent`."""
    add_control_plane_option(
        parser, help="ws:// or wss:// address of /agent/ws; repeat for several control-plane processes"
    )
    parser.add_argument("--node", required=True, help="this node's enrolled name")
    parser.add_argument("--token", default=None, help="the node credential (default: $LLMGW_NODE_TOKEN)")
    _add_gpu_arguments(parser)
    _add_report_arguments(parser)
    _add_machine_arguments(parser)
    _add_tls_arguments(parser)


def _add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """Simulated GPUs and their health, for drills and machines without GPUs."""
    parser.add_argument("--fake-gpus", default=None, help="simulate GPUs, e.g. 8xH100-80GB or 4xL40S-48GB,2xA100-40GB")
    parser.add_argument(
        "--fake-gpu-health",
        default=None,
        metavar="FILE",
        help='with --fake-gpus: a JSON file {"INDEX": "reason"} naming the simulated GPUs that are unhealthy '
        "now, read again before each heartbeat when it changes (for drills)",
    )


def _add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """What the node reports of itself, and how often."""
    parser.add_argument("--fabric", default="", help="interconnect domain of this node, e.g. ib-a")
    parser.add_argument(
        "--address", default=None, help="host or IP engines listen on and are reached on (default: this host's FQDN)"
    )
    parser.add_argument("--label", action="append", dest="labels", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=None,
        help=f"seconds between heartbeats (default: ${HEARTBEAT_ENV}, else {DEFAULT_HEARTBEAT_SECONDS:g})",
    )


def _add_machine_arguments(parser: argparse.ArgumentParser) -> None:
    """Where things are on this machine: the engines' commands, the weights, the agent's own state."""
    parser.add_argument(
        "--llama-server",
        default=None,
        metavar="PATH",
        help=f"llama.cpp server binary, a name on PATH or a path (default: ${LLAMA_SERVER_ENV}, "
        f"else {DEFAULT_LLAMA_SERVER})",
    )
    parser.add_argument(
        "--vllm-command",
        default=None,
        metavar="COMMAND",
        help=f"what starts vLLM's OpenAI server, split as a shell would: 'vllm serve', '/opt/vllm/bin/vllm serve' "
        f"or '/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server' (default: ${VLLM_COMMAND_ENV}, else the "
        "CPU build `make vllm` cached, else 'vllm serve' from PATH)",
    )
    parser.add_argument(
        "--weights-root",
        default=None,
        metavar="DIR",
        help=f"folder holding model weights (Hugging Face cache under hub/, GGUF files); reported to the "
        f"control plane and given to engines as HF_HOME (default: ${WEIGHTS_ROOT_ENV}, else none)",
    )
    parser.add_argument(
        "--weights-port",
        default=None,
        metavar="PORT",
        help="where the agent's weights server listens, so other nodes copy the weights this one holds instead of "
        "asking the hub again (only the copies the control plane allows; default: none, it copies from peers but "
        "serves none); needs --weights-root",
    )
    parser.add_argument(
        "--weights-budget",
        default=None,
        metavar="SIZE",
        help="the most the weights under --weights-root may take (500G, 1.5T, 800GiB): staging beyond it first "
        "removes weights no engine here runs and no profile pins, least recently used first (default: the disk)",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        help=f"where the agent remembers its node name and the highest leader epoch seen (default: ${STATE_DIR_ENV}, "
        f"else /var/lib/llmgw-agent for root, ~/.local/state/llmgw-agent otherwise)",
    )


def _add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """The files of a wss:// link: the CA the control plane's certificate chains to, the node's own."""
    parser.add_argument(
        "--ca-file",
        default=None,
        help=f"PEM bundle the control plane's wss:// certificate must chain to (default: ${CA_FILE_ENV}, "
        "else the system's trusted CAs)",
    )
    parser.add_argument(
        "--cert-file",
        default=None,
        help=f"this node's PEM certificate, for a control plane that requires one (default: ${CERT_FILE_ENV})",
    )
    parser.add_argument(
        "--key-file", default=None, help=f"the private key of --cert-file (default: ${KEY_FILE_ENV}, else in it)"
    )


def parse_labels(items: list[str]) -> dict[str, str]:
    """`k=v` strings to a dict; UsageError names the first bad one."""
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not LABEL_KEY.match(key):
            raise UsageError(f"Label {item!r} is not key=value with a key of letters, digits and . _ / -.")
        labels[key] = value
    return labels


def heartbeat_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """The heartbeat interval from LLMGW_HEARTBEAT_SECONDS, as the control plane's settings read it."""
    value = environ.get(HEARTBEAT_ENV, "")
    if not value.strip():
        return DEFAULT_HEARTBEAT_SECONDS
    try:
        seconds = float(value)
    except ValueError:
        raise UsageError(f"{HEARTBEAT_ENV}={value!r} is not a number.") from None
    if math.isnan(seconds) or seconds < MIN_HEARTBEAT_SECONDS:
        raise UsageError(f"{HEARTBEAT_ENV}={value!r} must be a number of at least {MIN_HEARTBEAT_SECONDS}.")
    return seconds


def llama_server_from(option: str | None, environ: Mapping[str, str] = os.environ) -> str:
    """The llama.cpp server binary: the option, else LLMGW_LLAMA_SERVER, else `llama-server` on PATH."""
    if option is not None:
        if not option.strip():
            raise UsageError("--llama-server must name a binary, not be empty.")
        return option
    value = environ.get(LLAMA_SERVER_ENV)
    if value is None or not value.strip():
        return DEFAULT_LLAMA_SERVER
    return value


def vllm_command_option(option: str | None, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The vLLM command: the option, else LLMGW_VLLM_COMMAND, else the cached CPU build, else `vllm serve`."""
    if option is not None and not option.strip():
        raise UsageError("--vllm-command must name a command, not be empty.")
    value, name = (
        (option, "--vllm-command") if option is not None else (environ.get(VLLM_COMMAND_ENV), VLLM_COMMAND_ENV)
    )
    try:
        return vllm_command_from(value, environ, name)
    except ValueError as exc:
        raise UsageError(f"{exc}.") from None


def weights_root_from(option: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """The weights root from --weights-root or LLMGW_WEIGHTS_ROOT: an existing folder, made absolute; None if unset."""
    value, name = (
        (option, "--weights-root") if option is not None else (environ.get(WEIGHTS_ROOT_ENV), WEIGHTS_ROOT_ENV)
    )
    if value is None or not value.strip():
        if option is not None:
            raise UsageError("--weights-root is empty; give a folder, or leave the option out.")
        return None
    if not os.path.isdir(value):
        raise UsageError(f"{name}={value!r} is not an existing folder.")
    return os.path.abspath(value)


def agent_from_options(options: Mapping[str, Any], default_heartbeat: float) -> Agent:
    """The Agent the parsed options describe; UsageError names the first bad option."""
    control_planes = options["control_planes"]
    if not control_planes:
        raise UsageError("Give at least one --control-plane ws://HOST:PORT/agent/ws address.")
    for uri in control_planes:
        problem = address_problem(uri)
        if problem is not None:
            raise UsageError(f"{problem[0].upper()}{problem[1:]}.")
    node = options["node"]
    if not NODE_NAME.match(node):
        raise UsageError(f"Node name {node!r} must be letters, digits and . _ - (at most 63 characters).")
    token = options["token"] or os.environ.get("LLMGW_NODE_TOKEN", "")
    if not token:
        raise UsageError("Give the node credential with --token or the LLMGW_NODE_TOKEN environment variable.")
    heartbeat = options["heartbeat_seconds"]
    if heartbeat is None:
        heartbeat = default_heartbeat
    if not heartbeat > 0:
        raise UsageError(f"--heartbeat-seconds must be positive, got {heartbeat}.")
    labels = parse_labels(options["labels"])
    weights_root = weights_root_from(options.get("weights_root"))
    weights_port = _weights_port(options.get("weights_port"), weights_root)
    weights_budget = _weights_budget(options.get("weights_budget"), weights_root)
    fake_health = options.get("fake_gpu_health")
    if fake_health is not None and not options["fake_gpus"]:
        raise UsageError("--fake-gpu-health goes with --fake-gpus; real GPUs report their own health.")
    tls = _tls_files(options, control_planes)
    state_dir = options.get("state_dir") or os.environ.get(STATE_DIR_ENV, "").strip() or default_state_dir()
    gpus, health = _gpus_and_health(options["fake_gpus"], fake_health, node)
    try:
        agent_options = AgentOptions(
            control_planes,
            node,
            token,
            gpus,
            address=options["address"] or socket.getfqdn(),
            fabric=options["fabric"],
            labels=labels,
            heartbeat_seconds=heartbeat,
            llama_server=llama_server_from(options.get("llama_server")),
            vllm_command=vllm_command_option(options.get("vllm_command")),
            weights_root=weights_root,
            weights_port=weights_port,
            weights_budget=weights_budget,
            state_dir=state_dir,
            **tls,
        )
        return Agent(agent_options, health)
    except StateError as exc:
        raise UsageError(f"{str(exc)[0].upper()}{str(exc)[1:]}.") from None
    except ValueError as exc:
        raise UsageError(f"{exc}.") from None


def _weights_port(option: str | None, weights_root: str | None) -> int | None:
    """The weights server's port from --weights-port (None: no server); UsageError naming what is wrong."""
    if option is None:
        return None
    if weights_root is None:
        raise UsageError("--weights-port serves the weights under --weights-root; give that too.")
    try:
        return parse_port(option)
    except ValueError as exc:
        raise UsageError(f"--weights-port: {exc}.") from None


def _weights_budget(option: str | None, weights_root: str | None) -> int | None:
    """The weights budget in bytes from --weights-budget (None: none); UsageError naming what is wrong."""
    if option is None:
        return None
    if weights_root is None:
        raise UsageError("--weights-budget bounds the weights under --weights-root; give that too.")
    try:
        return parse_size(option)
    except ValueError as exc:
        raise UsageError(f"--weights-budget: {exc}.") from None


def _gpus_and_health(
    fake_gpus: str | None, fake_health: str | None, node: str
) -> tuple[list[GPUInfo], HealthReader | None]:
    """This node's GPUs (real, or simulated from --fake-gpus) and what reads their health."""
    try:
        gpus = discover_gpus(fake_gpus, node)
    except (ValueError, GPUDiscoveryError) as exc:
        raise UsageError(f"Cannot discover GPUs: {exc}.") from None
    health: HealthReader | None = None  # fake GPUs: simulated health
    if fake_health is not None:
        health = SimulatedHealth({g.index: HEALTHY for g in gpus}, watch=os.path.abspath(fake_health))
    elif not fake_gpus:
        try:
            health = hardware_reader({g.index: g.uuid for g in gpus}, shutil.which("nvidia-smi"))
        except RuntimeError as exc:
            raise UsageError(f"Cannot read GPU health: {exc}.") from None
    return gpus, health


class TLSFiles(TypedDict):
    """The agent's TLS files, as AgentOptions takes them (None: not given)."""

    ca_file: str | None
    cert_file: str | None
    key_file: str | None


def _tls_files(options: Mapping[str, Any], control_planes: list[str]) -> TLSFiles:
    """--ca-file, --cert-file and --key-file (or their variables), each checked to be a readable file."""

    def readable(option: str, env: str) -> str | None:
        value = options.get(option) or os.environ.get(env, "").strip() or None
        flag = "--" + option.replace("_", "-")
        if value is not None and not os.access(value, os.R_OK):
            raise UsageError(f"{flag} {value!r} is not a readable file.")
        return value

    files = TLSFiles(
        ca_file=readable("ca_file", CA_FILE_ENV),
        cert_file=readable("cert_file", CERT_FILE_ENV),
        key_file=readable("key_file", KEY_FILE_ENV),
    )
    if files["key_file"] and not files["cert_file"]:
        raise UsageError("--key-file needs --cert-file.")
    if any(files.values()) and not any(uri.startswith("wss://") for uri in control_planes):
        raise UsageError("--ca-file, --cert-file and --key-file need a wss:// control-plane address.")
    return files


def configure_logging(environ: Mapping[str, str] = os.environ) -> None:
    """Log as the control plane does: plain lines on stderr at $LOG_LEVEL (default INFO)."""
    level = environ.get("LOG_LEVEL", "").strip().upper() or "INFO"
    if not isinstance(logging.getLevelName(level), int):
        raise UsageError(f"LOG_LEVEL={level!r} is not a log level (DEBUG, INFO, WARNING, ERROR).")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: the agent's health polls would drown the log.
    logging.getLogger("httpx").setLevel(logging.WARNING)


def describe(agent: Agent) -> str:
    """The line printed when the agent starts."""
    return f"agent for node {agent.node}: {len(agent.gpus)} GPU(s), control plane {', '.join(agent.control_planes)}"


async def run_until_signalled(agent: Agent) -> None:
    """Run the agent until SIGINT or SIGTERM, then stop its engines; AgentRejected if refused."""
    loop = asyncio.get_running_loop()
    pending: list[asyncio.Future] = []

    def on_signal() -> None:
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


def main(argv: list[str] | None = None, prog: str = "python -m agent") -> int:
    """Entry point of `python -m agent` and `llmgw agent`; returns the exit code (2: bad arguments)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the node agent: connect to the control plane and start or stop engine shards "
        "on this node's GPUs.",
    )
    add_arguments(parser)
    options = vars(parser.parse_args(argv))
    try:
        agent = agent_from_options(options, heartbeat_from_env())
        configure_logging()
        print(describe(agent), flush=True)
        asyncio.run(run_until_signalled(agent))
    except UsageError as exc:  # a bad command line: exit 2, as argparse does for the rest
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 2
    except AgentRejected as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        return 1
    print(f"agent for node {agent.node} stopped", flush=True)
    return 0
