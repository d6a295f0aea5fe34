"""The out-of-memory drill: 100 random placements of mixed models on a mixed fleet, 0 out-of-memory starts.

Each model's true need per GPU is worked out here from its shape, independently
of catalog/memory.py (weights ÷ GPUs + vLLM's overheads + the KV cache of one
full-length sequence), and every placement the tick makes is checked with the
mock engine's own rule (`mockengine.server.out_of_memory`, what the mock told
that need does on the placed GPUs' reported memory). Every refusal for memory
must name the numbers.
"""

import math
import os
import random
import re

import pytest

from catalog.models import Model, Profile
from inventory.models import GPU
from mockengine.server import out_of_memory
from reconciler.choices import ReplicaState
from reconciler.models import GPUAssignment, Replica
from tests.fleet import make_node

pytestmark = pytest.mark.django_db

GIB = 1 << 30
FLEET = {"H100-80GB": (8, 2), "L40S-48GB": (4, 2), "A10-24GB": (4, 2)}  # class: (GPUs per node, nodes)
# (billions of parameters, layers, KV heads, head dim): Qwen2.5-1.5B, Llama 3.1 8B, Qwen2.5-32B, Llama 3.1 70B.
SHAPES = [(1.5, 28, 2, 128), (8.0, 32, 8, 128), (32.8, 64, 8, 128), (70.6, 80, 8, 128)]
DTYPES = {"bfloat16": 16, "fp8": 8, "int4": 4}
CONTEXTS = [4096, 8192, 32768, 131072]
VLLM_OVERHEAD = 2.5 * GIB  # CUDA context 0.5 + activation peak 1.5 + CUDA graphs 0.5 (vLLM's start-up profile)


def true_need_gib(params_b, layers, kv_heads, head_dim, dtype, context, gpus) -> float:
    """What the engine really takes per GPU: weights split over the GPUs, overheads, one full-length sequence."""
    weights = math.ceil(params_b * 1e9 * DTYPES[dtype] / 8 / gpus)
    kv_bytes = 2 if DTYPES[dtype] < 16 else DTYPES[dtype] // 8  # quantized weights compute (and cache) in 16 bits
    kv = 2 * layers * math.ceil(kv_heads / gpus) * head_dim * kv_bytes * context
    return (weights + VLLM_OVERHEAD + kv) / GIB


def random_model(rng: random.Random, name: str) -> dict:
    params_b, layers, kv_heads, head_dim = rng.choice(SHAPES)
    dtype = rng.choice(list(DTYPES))
    model = Model.objects.create(
        name=name,
        source=f"org/{name}",
        parameters_billions=params_b,
        dtype=dtype,
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
    )
    profiles = []
    for order in range(rng.randint(1, 3)):
        gpu_class = rng.choice(list(FLEET))
        gpus = rng.choice([g for g in (1, 2, 4) if g <= FLEET[gpu_class][0]])
        context = rng.choice(CONTEXTS)
        need = true_need_gib(params_b, layers, kv_heads, head_dim, dtype, context, gpus)
        profile = Profile.objects.create(
            model=model,
            order=order,
            engine="mock",
            gpu_class=gpu_class,
            gpus_per_node=gpus,
            min_replicas=1,
            max_model_len=context,
            engine_args=["--memory-gib-per-gpu", f"{need:.3f}"],
        )
        profiles.append((profile, need))
    return {"model": model, "profiles": profiles}


# A fixed seed keeps the suite deterministic (a random one drew only 9 refusals once in CI);
# LLMGW_DRILL_SEED=random, or a number, runs other draws by hand.
SEED = os.environ.get("LLMGW_DRILL_SEED", "20261201")


def test_100_random_placements_start_no_engine_out_of_memory(run_tick):
    seed = random.randrange(1 << 30) if SEED == "random" else int(SEED)
    rng = random.Random(seed)
    for gpu_class, (gpus, nodes) in FLEET.items():
        for i in range(nodes):
            make_node(f"{gpu_class.lower()}-{i}", gpus=gpus, gpu_class=gpu_class)
    memory = dict(GPU.objects.values_list("pk", "memory_mb"))
    placed = refused_for_memory = 0
    for round_ in range(10):
        wanted = [random_model(rng, f"m{round_}-{i}") for i in range(10)]
        run_tick()
        for entry in wanted:
            replica = Replica.objects.select_related("profile").get(model=entry["model"])
            needs = {profile.pk: need for profile, need in entry["profiles"]}
            if replica.state == ReplicaState.STARTING:
                placed += 1
                gpus = GPUAssignment.objects.filter(shard__replica=replica).values_list("gpu_id", flat=True)
                oom = out_of_memory(needs[replica.profile_id], [memory[g] for g in gpus])
                assert oom is None, f"seed {seed}: {replica.profile} would fail: {oom}"
                continue
            # Not placed: every profile whose need exceeds its class's GPUs is refused with the numbers.
            for profile, need in entry["profiles"]:
                if out_of_memory(need, [FLEET_MEMORY_MIB[profile.gpu_class]]) is not None:
                    refused_for_memory += 1
                    said = re.findall(rf"needs (\d+\.\d) GiB per GPU; {profile.gpu_class} has", replica.placement_note)
                    # The estimate rounds to 0.1 GiB; this need is the drill's own float.
                    assert any(abs(float(x) - need) <= 0.051 for x in said), f"seed {seed}: {replica.placement_note!r}"
        Model.objects.all().delete()  # the next round on an empty fleet: its replicas, shards and GPUs go too
    # The drill means something only if both happened.
    assert placed >= 20 and refused_for_memory >= 10, (seed, placed, refused_for_memory)


FLEET_MEMORY_MIB = {gpu_class: int(gpu_class.split("-")[1].removesuffix("GB")) * 1024 for gpu_class in FLEET}


def test_the_mocks_rule_and_the_agents_variable():
    assert out_of_memory(73.6, [81920]) is None
    line = out_of_memory(44.3, [81920, 49152])
    assert line is not None and "GPU 1 has a total capacity of 48.00 GiB, of which 44.16 GiB may be used" in line
