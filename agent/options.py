"""What one node's agent is told when it starts: `AgentOptions`, built once by whoever runs it.

`python -m agent` builds it from its checked command line (agent/cli.py); the embedded runner
builds one per simulated node; tests and benches build their own. The agent reads it and keeps it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agent import draining
from agent.engines.launch import DEFAULT_LLAMA_SERVER
from agent.engines.load import POLL_TIMEOUT_SECONDS
from agent.engines.vllm_command import default_vllm_command
from agent.gpus.discovery import GPUInfo
from agent.weights.inventory import DEFAULT_SCAN_EVERY

STOP_GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class AgentOptions:
    """Where the control plane is, which node this is, and how its engines are run and watched.

    `state_dir` None keeps the highest leader epoch in memory only (tests, embedded demo agents);
    a node's agent has one so fencing survives its restarts (agent/state.py).
    """

    control_planes: Sequence[str]
    node: str
    token: str
    gpus: Sequence[GPUInfo]
    address: str
    fabric: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    heartbeat_seconds: float = 5.0
    engine_python: str = sys.executable
    llama_server: str = DEFAULT_LLAMA_SERVER
    # The argv that starts vLLM's OpenAI server, before its model (agent/engines/vllm_command.py).
    vllm_command: Sequence[str] = field(default_factory=default_vllm_command)
    health_timeout: float = 600.0
    stop_grace_seconds: float = STOP_GRACE_SECONDS
    load_timeout: float = POLL_TIMEOUT_SECONDS
    drain_poll_seconds: float = draining.DRAIN_POLL_SECONDS
    weights_root: str | None = None
    weights_scan_every: int = DEFAULT_SCAN_EVERY
    # Where staging asks for hub weights (agent/weights/staging.py); None: HF_ENDPOINT, else the public hub.
    hub_endpoint: str | None = None
    # Where the weights server listens for peers' copies (agent/weights/peer_server.py); None: it does not run.
    weights_port: int | None = None
    # The most bytes of weights the root may hold (agent/weights/budget.py); None: as much as the disk takes.
    weights_budget: int | None = None
    weights_bind: str = "0.0.0.0"  # noqa: S104 - peers on other hosts copy from it; tickets guard it
    state_dir: str | os.PathLike | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def __post_init__(self) -> None:
        # Copies, so a caller's later change to its list or dict cannot reach a running agent.
        object.__setattr__(self, "control_planes", tuple(self.control_planes))
        object.__setattr__(self, "gpus", tuple(self.gpus))
        object.__setattr__(self, "vllm_command", tuple(self.vllm_command))
        object.__setattr__(self, "labels", dict(self.labels))
