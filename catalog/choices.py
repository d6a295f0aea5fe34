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
