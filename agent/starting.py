"""What a `start_shard` becomes on this node: the engine's launch (agent/engines/launch.py) and the environment it adds.

Kept apart from agent/runtime.py, which carries the start out: these are pure functions of the command, the
agent's options and the node's GPUs.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent.engines.launch import Launch, build_launch
from agent.gpus.discovery import GPUInfo
from agent.options import AgentOptions
from nodewire import engine_env, protocol


def launch_for(cmd: protocol.StartShard, options: AgentOptions, gpus: Sequence[GPUInfo]) -> Launch:
    """The launch of `cmd`'s shard; ValueError names what is wrong (a GPU not on this node, a bad argument)."""
    known = {g.index for g in gpus}
    missing = [i for i in cmd.gpu_indices if i not in known]
    if missing:
        raise ValueError(f"GPU indices {missing} are not on node {options.node}")
    adapters = cmd.adapters if isinstance(cmd.adapters, protocol.AdapterSlots) else None
    return build_launch(
        cmd.engine,
        model=cmd.model,
        source=cmd.source,
        port=cmd.port,
        gpu_indices=list(cmd.gpu_indices),
        rank=cmd.rank,
        node_count=cmd.node_count,
        head_address=cmd.head_address,
        args=list(cmd.args),
        host=cmd.host or options.address,
        rendezvous_port=cmd.rendezvous_port,
        sleep_mode=cmd.able_to_sleep,
        adapter_slots=adapters.slots if adapters else None,
        max_adapter_rank=adapters.max_rank if adapters else None,
        # --fake-gpus: the engine runs on the CPU, where GPU-only flags are refused.
        gpus_simulated=any(g.simulated for g in gpus if g.index in cmd.gpu_indices),
        python=options.engine_python,
        llama_server=options.llama_server,
        vllm_command=options.vllm_command,
    )


def added_env(
    cmd: protocol.StartShard, launch: Launch, options: AgentOptions, gpus: Sequence[GPUInfo]
) -> dict[str, str]:
    """The environment the agent adds to its own for the engine.

    The assigned GPUs (in launch.env) always win over a profile's environment (whose gate refuses the names
    the agent sets, nodewire/engine_env.py). Hub downloads land in the weights root, where the weights inventory
    looks (nodewire/weights/disk.py).
    """
    weights_env = {"HF_HOME": options.weights_root} if options.weights_root else {}
    return {**weights_env, **cmd.env, **launch.env, **gpu_memory_env(cmd.gpu_indices, gpus)}


def gpu_memory_env(indices: Sequence[int], gpus: Sequence[GPUInfo]) -> dict[str, str]:
    """The placed GPUs' memory (MiB each, in CUDA_VISIBLE_DEVICES order), so an engine can tell whether it fits."""
    memory = {g.index: g.memory_mb for g in gpus}
    return {engine_env.GPU_MEMORY_ENV: ",".join(str(memory[i]) for i in indices if i in memory)}
