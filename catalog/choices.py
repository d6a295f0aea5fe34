"""Constant-backed choices for the catalog."""

from django.db import models


class Engine(models.TextChoices):
    VLLM = "vllm", "vLLM"
    SGLANG = "sglang", "SGLang"
    LLAMACPP = "llamacpp", "llama.cpp"
    MOCK = "mock", "mock (bundled test engine)"


class WeightsDtype(models.TextChoices):
    """How a model's weights are stored, in the names catalog/parameters.py sizes (torch dtypes, ggml types)."""

    FLOAT32 = "float32", "float32"
    BFLOAT16 = "bfloat16", "bfloat16"
    FLOAT16 = "float16", "float16"
    FP8 = "fp8", "fp8"
    INT8 = "int8", "int8 (8-bit quantized)"
    INT4 = "int4", "int4 (4-bit quantized)"
    Q8_0 = "Q8_0", "GGUF Q8_0"
    Q6_K = "Q6_K", "GGUF Q6_K"
    Q5_K = "Q5_K", "GGUF Q5_K"
    Q4_K = "Q4_K", "GGUF Q4_K"
    Q4_0 = "Q4_0", "GGUF Q4_0"


class SleepLevel(models.IntegerChoices):
    """How a profile's idle replicas give their GPUs up (the hibernate tier) instead of stopping."""

    NEVER = 0, "0: never sleep, stop instead"
    OFFLOAD = 1, "1: weights to host memory (fastest wake)"
    DISCARD = 2, "2: weights discarded, reloaded from disk on wake"


# The sleep levels each engine serves (vLLM's sleep mode, SGLang's memory release, the mock's model of
# vLLM's); an engine not listed cannot sleep and is stopped instead, as before the hibernate tier.
ENGINE_SLEEP_LEVELS: dict[str, tuple[int, ...]] = {
    Engine.VLLM: (SleepLevel.OFFLOAD, SleepLevel.DISCARD),
    Engine.SGLANG: (SleepLevel.OFFLOAD,),
    Engine.MOCK: (SleepLevel.OFFLOAD, SleepLevel.DISCARD),
}
