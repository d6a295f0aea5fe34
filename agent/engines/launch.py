"""Per-engine launch builders: the argv and environment that start one shard.

Engines are always started from an argv list, never through a shell, so a
model source or a profile's engine argument cannot inject a command.

Multi-node rules (node_count > 1, rank 0 is the head). Every rank of a
replica gets the same engine arguments (the profile's included) plus its own
rank, the head's address and the rendezvous port: a port on the head node the
control plane reserves beside the head's engine port (start_shard's
`rendezvous_port`). The control plane starts rank 0 first and the other ranks
once rank 0's engine runs, because rank 0 hosts the rendezvous (a torch TCP
store) that the others join; they keep retrying to join for the engine's
distributed timeout, so a head that is merely slower is no failure.

* vLLM spans nodes with its own multiprocessing launch (vLLM 0.32's `vllm serve`
  `--nnodes/--node-rank/--master-addr/--master-port`, executor backend `mp`):
  no Ray cluster to run beside the agent. Tensor parallel inside a node,
  pipeline parallel across nodes (`--tensor-parallel-size` GPUs of the shard,
  `--pipeline-parallel-size` nodes). Rank 0 serves the API; the other ranks run
  `--headless` (a mode only `vllm serve` has, not `python -m
  vllm.entrypoints.openai.api_server`) and serve no HTTP: the agent reports
  them ready once their process has stayed up. The replica is ready only when
  rank 0 answers /health, which vLLM does only after every rank has joined.
  vLLM's head picks its own address for the message queue the other nodes
  connect to (`VLLM_HOST_IP`, else a guess from the default route): when the
  node's management address is an IP, every rank gets it as VLLM_HOST_IP.
  The command that starts vLLM is the agent's (`LLMGW_VLLM_COMMAND`, agent/engines/vllm_command.py):
  `vllm serve MODEL` from PATH, or the CPU build `make vllm` caches, run as a module with `--model MODEL`;
  a replica across nodes needs a `vllm serve` command.
* SGLang runs one `launch_server` per node with `--nnodes/--node-rank` and
  `--dist-init-addr <head>:<rendezvous port>`, `--tp-size` over all the
  replica's GPUs. Ranks above 0 answer /health (SGLang 0.5's stand-in health
  server, up once their schedulers are) but serve no API, so they have no
  metrics path.
* llama.cpp runs on one node only. Its server is the `llama-server` binary,
  found on PATH unless the agent is given another (`LLMGW_LLAMA_SERVER`, a name
  or a path; `manage.py build_llama_server` builds one). The flags are those of
  llama.cpp's `tools/server` as vendored by llama-cpp-python 0.3.36 (runner/llama_server.py).
* The mock engine runs a full server on every rank, so simulated multi-node
  replicas answer health checks everywhere.

Every engine listens on `host`, the node's management address: the one its
endpoint is published on (start_shard's `host`, else the agent's `--address`),
never on every interface. All four take `--host`.

Sleep (the hibernate tier, agent/hibernation.py). A shard started with `sleep_mode` can be put to sleep
and woken without a restart; each launch says how (`Launch.sleep`, a dialect of agent/engines/sleep.py):
* vLLM: `VLLM_SERVER_DEV_MODE=1` (its `/sleep`, `/wake_up`, `/is_sleeping`, `/collective_rpc` and
  `/reset_prefix_cache` routes, served on the management address like every route) and
  `--enable-sleep-mode`, which vLLM's CPU build refuses at start-up ("Sleep mode is not supported on
  current platform"). So the flag goes only to shards on real GPUs: on GPUs simulated with `--fake-gpus`
  the engine runs on the CPU, where the dev routes alone give the real state machine (vLLM's CPU worker
  ignores the memory part). Ranks above 0 sleep with their head (vLLM's sleep reaches every worker).
* SGLang: `--enable-memory-saver` (its `/release_memory_occupation` and `/resume_memory_occupation`) with
  `--enable-weights-cpu-backup`, so the weights wait in host memory: level 1 only.
* The mock engine: the same environment as vLLM, whose sleep routes it imitates.
* llama.cpp has no sleep: it is stopped instead.

LoRA adapters. A shard started with `adapters` (its profile's max adapters, and max adapter rank when set)
has LoRA on, so adapters can be loaded and unloaded while it runs; the load routes are served on the
management address like every route:
* vLLM: `--enable-lora --max-loras N [--max-lora-rank R]` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`
  (its `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`); without a rank vLLM takes 16.
* SGLang: `--enable-lora --max-loras-per-batch N --lora-target-modules all [--max-lora-rank R]`: it starts
  with no adapter to infer the modules from, so all of them are made loadable (its `/load_lora_adapter`).
* The mock engine: the same flags and environment as vLLM, whose LoRA routes it imitates.
* llama.cpp takes adapters only at start-up: refused.
Every rank gets the same flags: a replica's engines must agree on their LoRA shape. Each launch says how its
engine loads and unloads adapters (`Launch.adapters`, a dialect of agent/engines/adapters.py): a real engine's
ranks above 0 serve no API and hold what their head loads (`follower`).

Each launch also says where the engine publishes its Prometheus metrics (the
agent reads its requests in flight there, agent/engines/load.py): vLLM always
serves `/metrics`; SGLang only with `--enable-metrics` and llama.cpp's server
only with `--metrics`, so the builders add those flags. Ranks that serve no
HTTP have no metrics path.
"""

from __future__ import annotations

import ipaddress
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.engines.vllm_command import DEFAULT_VLLM_COMMAND, model_arguments
from nodewire.engine_env import VLLM_DEV_MODE_ENV, VLLM_RUNTIME_LORA_ENV

ENGINES = ("vllm", "sglang", "llamacpp", "mock")
DEFAULT_LLAMA_SERVER = "llama-server"
_NO_RUNTIME_ADAPTERS = "llama.cpp cannot load adapters at run time"
# The mock engine is imported from this checkout, whatever directory the agent was started from.
PROJECT_DIR = str(Path(__file__).resolve().parents[2])


@dataclass(frozen=True)
class Launch:
    """How to start one shard: argv (no shell), extra environment, and where it reports health and load.

    `health_path` is None for ranks that serve no HTTP; those are ready once
    their process has stayed up. `metrics_path` is None when the engine's
    requests in flight cannot be read (a drain then stops it at once).
    `cwd` is None to inherit the agent's. `host` is the address the engine
    listens on, where the agent reads its health and load too.
    """

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health_path: str | None = "/health"
    cwd: str | None = None
    metrics_path: str | None = "/metrics"
    host: str = "127.0.0.1"
    # How the engine sleeps (agent/engines/sleep.py), or None with `no_sleep` saying why it cannot.
    sleep: str | None = None
    no_sleep: str = ""
    # How the engine loads LoRA adapters (agent/engines/adapters.py), or None with `no_adapters` saying why it cannot.
    adapters: str | None = None
    no_adapters: str = ""

    @property
    def url_host(self) -> str:
        """`host` as it goes into a URL, where the agent reaches the engine (a wildcard means this machine)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"[{host}]" if ":" in host else host


def _check(engine, model, source, port, gpu_indices, rank, node_count, head_address, args, host) -> None:
    if not isinstance(host, str) or not host or host.startswith("-") or any(c.isspace() for c in host):
        raise ValueError(f"host to listen on must be an address or host name, got {host!r}")
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; expected one of {', '.join(ENGINES)}")
    if not isinstance(model, str) or not model:
        raise ValueError("model name must be a non-empty string")
    if not isinstance(source, str) or not source:
        raise ValueError("model source must be a non-empty string")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer from 1 to 65535, got {port!r}")
    if not isinstance(gpu_indices, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in gpu_indices
    ):
        raise ValueError(f"GPU indices must be a list of non-negative integers, got {gpu_indices!r}")
    if len(set(gpu_indices)) != len(gpu_indices):
        raise ValueError(f"GPU indices {gpu_indices} repeat a GPU")
    if not gpu_indices and engine != "mock":
        raise ValueError(f"engine {engine} needs at least one GPU")
    if isinstance(node_count, bool) or not isinstance(node_count, int) or node_count < 1:
        raise ValueError(f"node count must be a positive integer, got {node_count!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < node_count:
        raise ValueError(f"rank must be from 0 to {node_count - 1}, got {rank!r}")
    if node_count > 1 and (not isinstance(head_address, str) or not head_address):
        raise ValueError("a replica spanning several nodes needs the head node's address")
    if engine == "llamacpp" and node_count > 1:
        raise ValueError("llama.cpp runs on one node; node count must be 1")
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError("engine args must be a list of strings (an argv), not a shell string")


def _check_rendezvous(node_count, rendezvous_port) -> None:
    if node_count > 1 and (
        isinstance(rendezvous_port, bool) or not isinstance(rendezvous_port, int) or not 1 <= rendezvous_port <= 65535
    ):
        raise ValueError(
            f"a replica spanning several nodes needs a rendezvous port from 1 to 65535, got {rendezvous_port!r}"
        )


def build_launch(
    engine: str,
    *,
    model: str,
    source: str,
    port: int,
    gpu_indices: list[int],
    rank: int,
    node_count: int,
    head_address: str,
    args: list[str],
    host: str,
    rendezvous_port: int = 0,
    sleep_mode: bool = False,
    adapter_slots: int | None = None,
    max_adapter_rank: int | None = None,
    gpus_simulated: bool = False,
    python: str = sys.executable,
    llama_server: str = DEFAULT_LLAMA_SERVER,
    vllm_command: Sequence[str] = DEFAULT_VLLM_COMMAND,
) -> Launch:
    """The launch for one shard of `model` on this node, listening on `host`; ValueError names any bad input.

    `sleep_mode` starts the engine able to sleep; `adapter_slots` (with `max_adapter_rank`, None = the engine's
    default) with LoRA on; `gpus_simulated` says its GPUs are `--fake-gpus` ones.
    """
    _check(engine, model, source, port, gpu_indices, rank, node_count, head_address, args, host)
    _check_rendezvous(node_count, rendezvous_port)
    shard = _Shard(model, source, port, gpu_indices, rank, node_count, head_address, args, host, rendezvous_port)
    if engine == "vllm":
        launch = _vllm(shard, vllm_command)
    elif engine == "sglang":
        launch = _sglang(shard)
    elif engine == "llamacpp":
        launch = _llamacpp(shard, llama_server)
    else:
        launch = _mock(shard, python)
    launch = _with_adapters(launch, engine, shard.rank, adapter_slots, max_adapter_rank)
    return _able_to_sleep(launch, engine, shard.rank, sleep_mode, gpus_simulated)


def _with_adapters(launch: Launch, engine: str, rank: int, slots: int | None, max_rank: int | None) -> Launch:
    """`launch` with LoRA on (the module's docstring), or as it is, saying why, when the shard takes no adapters."""
    if slots is None:
        if max_rank is not None:
            raise ValueError("a max adapter rank needs adapter slots")
        reason = f"shard was started without adapter slots, so its {engine} engine takes none"
        return replace(launch, no_adapters=_NO_RUNTIME_ADAPTERS if engine == "llamacpp" else reason)
    for what, value in (("adapter slots", slots), ("max adapter rank", max_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{what} must be a positive integer, got {value!r}")
    if engine == "llamacpp":
        raise ValueError(f"{_NO_RUNTIME_ADAPTERS}; start it without adapter slots")
    rank_flags = ["--max-lora-rank", str(max_rank)] if max_rank is not None else []
    # The mock serves every rank itself; a real engine's other ranks load what their head loads.
    dialect = "follower" if rank > 0 and engine != "mock" else ("sglang" if engine == "sglang" else "vllm")
    if engine == "sglang":
        flags = ["--enable-lora", "--max-loras-per-batch", str(slots), "--lora-target-modules", "all", *rank_flags]
        return replace(launch, argv=[*launch.argv, *flags], adapters=dialect)
    flags = ["--enable-lora", "--max-loras", str(slots), *rank_flags]
    env = {**launch.env, VLLM_RUNTIME_LORA_ENV: "true"}
    return replace(launch, argv=[*launch.argv, *flags], env=env, adapters=dialect)


def _able_to_sleep(launch: Launch, engine: str, rank: int, sleep_mode: bool, gpus_simulated: bool) -> Launch:
    """`launch` with what lets its engine sleep (the module's docstring), or the reason it cannot."""
    if engine == "llamacpp":
        return replace(launch, no_sleep="llama.cpp has no sleep mode; stop it instead")
    if not sleep_mode:
        return replace(launch, no_sleep=f"shard was started without sleep_mode, so its {engine} engine cannot sleep")
    argv, env = list(launch.argv), dict(launch.env)
    if engine in ("vllm", "mock"):
        env[VLLM_DEV_MODE_ENV] = "1"
        if engine == "vllm" and not gpus_simulated:
            argv.append("--enable-sleep-mode")
    else:
        argv += ["--enable-memory-saver", "--enable-weights-cpu-backup"]
    # The mock serves every rank itself; a real engine's other ranks sleep with their head.
    dialect = "follower" if rank > 0 and engine != "mock" else ("sglang" if engine == "sglang" else "vllm")
    return replace(launch, argv=argv, env=env, sleep=dialect)


@dataclass(frozen=True)
class _Shard:
    """One shard of a replica as build_launch was given it, checked."""

    model: str
    source: str
    port: int
    gpu_indices: list[int]
    rank: int
    node_count: int
    head_address: str
    args: list[str]
    host: str
    rendezvous_port: int = 0

    @property
    def env(self) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in self.gpu_indices)}


def _vllm(shard: _Shard, command: Sequence[str]) -> Launch:
    if not command:
        raise ValueError("the vLLM command is empty; name one with LLMGW_VLLM_COMMAND")
    if shard.node_count > 1 and command[-1] != "serve":
        # --headless, which the ranks above 0 need, is a mode of `vllm serve` only.
        raise ValueError(
            f"a vLLM replica across nodes needs a `vllm serve` command (LLMGW_VLLM_COMMAND), not {shlex.join(command)!r}"
        )
    argv = [*command, *model_arguments(command, shard.source), "--host", shard.host, "--port", str(shard.port)]
    argv += ["--served-model-name", shard.model, "--tensor-parallel-size", str(len(shard.gpu_indices))]
    if shard.node_count == 1:
        return Launch(argv + shard.args, shard.env, host=shard.host)
    argv += ["--pipeline-parallel-size", str(shard.node_count), "--distributed-executor-backend", "mp"]
    argv += ["--nnodes", str(shard.node_count), "--node-rank", str(shard.rank)]
    argv += ["--master-addr", shard.head_address, "--master-port", str(shard.rendezvous_port)]
    env = shard.env | ({"VLLM_HOST_IP": shard.host} if _is_ip(shard.host) else {})
    if shard.rank > 0:
        # Headless: this node's workers join rank 0's; it serves no API and no metrics.
        return Launch(argv + ["--headless"] + shard.args, env, None, metrics_path=None, host=shard.host)
    return Launch(argv + shard.args, env, host=shard.host)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _sglang(shard: _Shard) -> Launch:
    argv = ["python", "-m", "sglang.launch_server", "--model-path", shard.source, "--host", shard.host]
    argv += ["--port", str(shard.port), "--served-model-name", shard.model]
    argv += ["--tp-size", str(len(shard.gpu_indices) * shard.node_count)]
    # On every rank: SGLang expects the same server arguments on each node of a replica.
    argv += ["--enable-metrics"]
    if shard.node_count > 1:
        argv += ["--nnodes", str(shard.node_count), "--node-rank", str(shard.rank)]
        argv += ["--dist-init-addr", f"{shard.head_address}:{shard.rendezvous_port}"]
    # Ranks above 0 answer /health on their own port, but their load is rank 0's to report.
    metrics_path = "/metrics" if shard.rank == 0 else None
    return Launch(argv + shard.args, shard.env, "/health", metrics_path=metrics_path, host=shard.host)


def _llamacpp(shard: _Shard, llama_server: str) -> Launch:
    argv = [llama_server, "-m", shard.source, "--host", shard.host, "--port", str(shard.port)]
    argv += ["--alias", shard.model, "-ngl", "999", "--metrics"]
    return Launch(argv + shard.args, shard.env, host=shard.host)


def _mock(shard: _Shard, python: str) -> Launch:
    argv = [python, "-m", "mockengine", "--host", shard.host, "--port", str(shard.port), "--model", shard.model]
    return Launch(argv + shard.args, shard.env, cwd=PROJECT_DIR, host=shard.host)
