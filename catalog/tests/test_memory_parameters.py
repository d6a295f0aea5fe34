"""Parameter counts from real open models' config.json match their published totals within 1%.

Each entry holds the architecture facts of the model's public `config.json`
on the Hugging Face hub (only the keys the count reads) and the total its
publisher gives: the exact figure Hugging Face shows from the safetensors
metadata ("Model size … params") where it is one, else the model card's
rounded size (marked "label"). The memory model reads nothing else, so a
count off by one matrix (an untied head, a missing shared expert, a wrong
head dimension) misses by far more than 1% and fails.
"""

import pytest

from catalog.memory import config_weights_bytes
from catalog.parameters import ConfigError, ParameterCount, parameter_count


def dense(model_type, hidden, intermediate, layers, heads, kv_heads, vocab, **extra):
    return {
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        **extra,
    }


LLAMA_3_1_8B = dense("llama", 4096, 14336, 32, 32, 8, 128256, tie_word_embeddings=False, torch_dtype="bfloat16")
MISTRAL_7B = dense("mistral", 4096, 14336, 32, 32, 8, 32000, tie_word_embeddings=False, sliding_window=4096)
GEMMA_2_9B = dense("gemma2", 3584, 14336, 42, 16, 8, 256000, head_dim=256, sliding_window=4096, torch_dtype="float32")
QWEN_2_5_7B = dense("qwen2", 3584, 18944, 28, 28, 4, 152064, tie_word_embeddings=False, torch_dtype="bfloat16")
DEEPSEEK_V2_LITE = {
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "vocab_size": 102400,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V2 = {
    **DEEPSEEK_V2_LITE,
    "hidden_size": 5120,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_hidden_layers": 60,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "n_routed_experts": 160,
}
QWEN_1_5_MOE = dense(
    "qwen2_moe",
    2048,
    5632,
    24,
    16,
    16,
    151936,
    moe_intermediate_size=1408,
    shared_expert_intermediate_size=5632,
    num_experts=60,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    tie_word_embeddings=False,
)

# (name, config facts, published total, where the total comes from)
MODELS = [
    ("Llama-3.1-8B", LLAMA_3_1_8B, 8_030_261_248, "meta-llama/Llama-3.1-8B safetensors metadata"),
    (
        "Llama-3.1-70B",
        dense("llama", 8192, 28672, 80, 64, 8, 128256, tie_word_embeddings=False),
        70_553_706_496,
        "meta-llama/Llama-3.1-70B safetensors metadata",
    ),
    (
        "Llama-3.1-405B",
        dense("llama", 16384, 53248, 126, 128, 8, 128256, tie_word_embeddings=False),
        405_853_388_800,
        "meta-llama/Llama-3.1-405B safetensors metadata",
    ),
    (
        "Llama-3.2-1B (tied)",
        dense("llama", 2048, 8192, 16, 32, 8, 128256, tie_word_embeddings=True),
        1_235_814_400,
        "meta-llama/Llama-3.2-1B safetensors metadata",
    ),
    (
        "Llama-3.2-3B (tied)",
        dense("llama", 3072, 8192, 28, 24, 8, 128256, tie_word_embeddings=True),
        3_212_749_824,
        "meta-llama/Llama-3.2-3B safetensors metadata",
    ),
    (
        "Llama-2-7B (MHA)",
        dense("llama", 4096, 11008, 32, 32, 32, 32000, tie_word_embeddings=False),
        6_738_415_616,
        "meta-llama/Llama-2-7b-hf safetensors metadata",
    ),
    ("Qwen2.5-7B (qkv bias)", QWEN_2_5_7B, 7_615_616_512, "Qwen/Qwen2.5-7B safetensors metadata"),
    (
        "Qwen2.5-72B",
        dense("qwen2", 8192, 29568, 80, 64, 8, 152064, tie_word_embeddings=False),
        72_706_203_648,
        "Qwen/Qwen2.5-72B safetensors metadata",
    ),
    (
        "Qwen2.5-0.5B (tied)",
        dense("qwen2", 896, 4864, 24, 14, 2, 151936, tie_word_embeddings=True),
        494_032_768,
        "Qwen/Qwen2.5-0.5B safetensors metadata",
    ),
    ("Mistral-7B-v0.1", MISTRAL_7B, 7_241_732_096, "mistralai/Mistral-7B-v0.1 safetensors metadata"),
    (
        "Mistral-Nemo-12B (head_dim 128 ≠ 5120/32)",
        dense("mistral", 5120, 14336, 40, 32, 8, 131072, head_dim=128, tie_word_embeddings=False),
        12_247_782_400,
        "mistralai/Mistral-Nemo-Base-2407 safetensors metadata",
    ),
    (
        "Mixtral-8x7B",
        dense("mixtral", 4096, 14336, 32, 32, 8, 32000, num_local_experts=8, tie_word_embeddings=False),
        46_702_792_704,
        "mistralai/Mixtral-8x7B-v0.1 safetensors metadata",
    ),
    (
        "Mixtral-8x22B",
        dense("mixtral", 6144, 16384, 56, 48, 8, 32768, num_local_experts=8, tie_word_embeddings=False),
        141_000_000_000,
        "mistralai/Mixtral-8x22B-v0.1 model card (label: 141B)",
    ),
    ("Gemma-2-9B (tied, 4 norms)", GEMMA_2_9B, 9_241_705_984, "google/gemma-2-9b safetensors metadata"),
    (
        "Gemma-2-27B",
        dense("gemma2", 4608, 36864, 46, 32, 16, 256000, head_dim=128),
        27_227_128_320,
        "google/gemma-2-27b safetensors metadata",
    ),
    (
        "Gemma-2-2B",
        dense("gemma2", 2304, 9216, 26, 8, 4, 256000, head_dim=256),
        2_614_341_888,
        "google/gemma-2-2b safetensors metadata",
    ),
    (
        "Phi-3-mini-4k (MHA)",
        dense("phi3", 3072, 8192, 32, 32, 32, 32064, tie_word_embeddings=False),
        3_821_079_552,
        "microsoft/Phi-3-mini-4k-instruct safetensors metadata",
    ),
    (
        "Phi-3-medium-4k (GQA)",
        dense("phi3", 5120, 17920, 40, 40, 10, 32064, tie_word_embeddings=False),
        13_960_238_080,
        "microsoft/Phi-3-medium-4k-instruct safetensors metadata",
    ),
    (
        "DeepSeek-V2-Lite (MLA, MoE)",
        DEEPSEEK_V2_LITE,
        15_706_484_224,
        "deepseek-ai/DeepSeek-V2-Lite safetensors metadata",
    ),
    ("DeepSeek-V2 (MLA, q_lora)", DEEPSEEK_V2, 236_000_000_000, "deepseek-ai/DeepSeek-V2 model card (label: 236B)"),
    (
        "DeepSeek-V3 (MLA, 256 experts, router bias)",
        {
            **DEEPSEEK_V2,
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "vocab_size": 129280,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "first_k_dense_replace": 3,
        },
        671_000_000_000,
        "deepseek-ai/DeepSeek-V3 model card (label: 671B main model; 685B on the hub adds the MTP module)",
    ),
    (
        "Qwen3-8B (q/k norms)",
        dense("qwen3", 4096, 12288, 36, 32, 8, 151936, head_dim=128, tie_word_embeddings=False),
        8_200_000_000,
        "Qwen/Qwen3-8B model card (label: 8.2B)",
    ),
    (
        "Qwen3-30B-A3B (128 experts, no shared)",
        dense("qwen3_moe", 2048, 6144, 48, 32, 4, 151936, head_dim=128, moe_intermediate_size=768, num_experts=128),
        30_500_000_000,
        "Qwen/Qwen3-30B-A3B model card (label: 30.5B)",
    ),
    ("Qwen1.5-MoE-A2.7B (shared expert)", QWEN_1_5_MOE, 14_315_784_192, "Qwen/Qwen1.5-MoE-A2.7B safetensors metadata"),
    (
        "Qwen2-57B-A14B",
        dense(
            "qwen2_moe",
            3584,
            18944,
            28,
            28,
            4,
            151936,
            moe_intermediate_size=2560,
            shared_expert_intermediate_size=20480,
            num_experts=64,
            tie_word_embeddings=False,
        ),
        57_400_000_000,
        "Qwen/Qwen2-57B-A14B model card (label: 57B total; 57.4B in the Qwen2 report)",
    ),
]


def error_percent(computed, published):
    return 100 * (computed - published) / published


def accuracy_table():
    """model, computed, published, error % (the table this test checks; printed with -s)."""
    return [(name, parameter_count(config).total, published) for name, config, published, _ in MODELS]


def test_the_table_covers_at_least_fifteen_real_models_of_every_kind():
    kinds = {config["model_type"] for _, config, _, _ in MODELS}
    assert len(MODELS) >= 15
    assert {"llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "gemma2", "phi3", "deepseek_v2"} <= kinds


@pytest.mark.parametrize(("name", "config", "published", "source"), MODELS, ids=[m[0] for m in MODELS])
def test_parameter_count_is_within_one_percent_of_the_published_total(name, config, published, source):
    computed = parameter_count(config).total
    print(f"{name:45} {computed:>16,} {published:>16,} {error_percent(computed, published):+.3f}%")
    assert abs(error_percent(computed, published)) <= 1.0, f"{name}: {computed:,} vs {published:,} ({source})"


def test_exact_totals_match_to_the_parameter():
    # Where the publisher's figure is exact (safetensors metadata), the count is exact too: the rule counts what
    # the checkpoint holds, not an approximation of it.
    exact = [(n, c, p) for n, c, p, source in MODELS if "label" not in source]
    assert len(exact) >= 15
    assert [(n, parameter_count(c).total) for n, c, _ in exact] == [(n, p) for n, _, p in exact]


def test_tying_the_embeddings_drops_exactly_the_output_head():
    untied = parameter_count(LLAMA_3_1_8B)
    tied = parameter_count({**LLAMA_3_1_8B, "tie_word_embeddings": True})
    assert untied.total - tied.total == 128256 * 4096
    # Gemma ties by default when the config does not say.
    assert parameter_count(GEMMA_2_9B).embedding == 256000 * 3584


def test_the_breakdown_adds_up_and_separates_what_quantization_packs():
    count = parameter_count(LLAMA_3_1_8B)
    assert isinstance(count, ParameterCount)
    assert count.embedding == 2 * 128256 * 4096
    assert count.linear == 32 * (4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    assert count.other == 32 * 2 * 4096 + 4096  # two RMSNorms per layer and the final one


def test_deepseek_dense_first_layers_and_shared_experts_are_counted():
    lite = parameter_count(DEEPSEEK_V2_LITE).total
    all_moe = parameter_count({**DEEPSEEK_V2_LITE, "first_k_dense_replace": 0}).total
    # Layer 0 is dense (intermediate 10944) instead of 64 routed + 2 shared experts of 1408 and a router.
    moe_mlp = 64 * 3 * 2048 * 1408 + 3 * 2048 * 2 * 1408 + 64 * 2048
    assert all_moe - lite == moe_mlp - 3 * 2048 * 10944
    no_shared = parameter_count({**DEEPSEEK_V2_LITE, "n_shared_experts": 0}).total
    assert lite - no_shared == 26 * 3 * 2048 * 2 * 1408


def test_weights_bytes_follow_the_dtype_and_the_quantization():
    assert config_weights_bytes(LLAMA_3_1_8B) == 2 * 8_030_261_248
    assert config_weights_bytes({**LLAMA_3_1_8B, "torch_dtype": "float32"}) == 4 * 8_030_261_248
    count = parameter_count(LLAMA_3_1_8B)
    awq = {
        **LLAMA_3_1_8B,
        "torch_dtype": "float16",
        "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128},
    }
    # 4 bits per linear weight, plus a 16-bit scale and a 4-bit zero per 128; the rest stays 16-bit.
    assert (
        config_weights_bytes(awq)
        == (count.linear * 4 + count.linear * 20 // 128 + (count.total - count.linear) * 16) // 8
    )
    fp8 = {**LLAMA_3_1_8B, "quantization_config": {"quant_method": "fp8"}}
    assert config_weights_bytes(fp8) == count.linear + 2 * (count.total - count.linear)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"model_type": "bert"}, "model_type 'bert'"),
        ({**LLAMA_3_1_8B, "hidden_size": None}, "hidden_size"),
        ({**LLAMA_3_1_8B, "num_attention_heads": "32"}, "num_attention_heads"),
        ({**LLAMA_3_1_8B, "quantization_config": {"quant_method": "hqq"}}, "'hqq'"),
        ({**LLAMA_3_1_8B, "torch_dtype": "float7"}, "float7"),
    ],
)
def test_a_config_it_cannot_count_is_refused_naming_the_problem(config, named):
    with pytest.raises(ConfigError, match=named):
        config_weights_bytes(config)
