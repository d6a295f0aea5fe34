"""Constant-backed choices for the catalog."""

from django.db import models


class Engine(models.TextChoices):
    VLLM = "vllm", "vLLM"
    SGLANG = "sglang", "SGLang"
    LLAMACPP = "llamacpp", "llama.cpp"
    MOCK = "mock", "mock (bundled test engine)"
