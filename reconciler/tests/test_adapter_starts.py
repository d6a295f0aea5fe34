"""A replica of a profile that takes adapters is started with LoRA on (start_shard's `adapters`); others keep
the start's old shape."""

import json

import pytest

from nodewire import parts, protocol
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db


def test_a_profile_with_adapter_slots_starts_its_shards_with_lora_on(run_tick, agent_inbox):
    make_node("gpu-a", gpus=2)
    inbox = agent_inbox("gpu-a")
    make_model("llama", engine="vllm", sleep_level=0, max_adapters=8, max_adapter_rank=32)
    make_model("qwen", engine="vllm", sleep_level=0)

    run_tick()

    starts = {start["model"]: start for start in inbox()}
    assert starts["llama"]["adapters"] == {"slots": 8, "max_rank": 32}
    assert "adapters" not in starts["qwen"]
    # What the agent decodes: the typed slots.
    assert protocol.decode_command(json.dumps(starts["llama"])).adapters == parts.AdapterSlots(slots=8, max_rank=32)
