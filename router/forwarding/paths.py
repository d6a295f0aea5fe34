"""The paths the router proxies to a replica of the model a request's body names (router.app routes by them)."""

from __future__ import annotations

# Every JSON endpoint of the engines llmgw runs (vLLM 0.32, SGLang 0.5.23, llama.cpp's server as llama-cpp-python
# 0.3.36 vendors it) whose body names the `model`: proxied alike to a replica of it; a replica whose engine lacks
# the path answers with its own 404.
# Left out: bodies that name no model (SGLang's /generate, llama.cpp's /completion), the engines' controls
# (adapters, sleep, weights), multipart audio, cloud hosts' entry points (/invocations), and APIs off by default
# or of another shape (vLLM's scale-out and Cohere routes; SGLang's Ollama ones, which stream unless told not to).
PROXY_PATHS = frozenset(
    {
        # All three: OpenAI's and Anthropic's APIs, tokenizing.
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/rerank",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/tokenize",
        "/detokenize",
        # vLLM and SGLang.
        "/v1/score",
        "/v1/systemone",
        # vLLM and llama.cpp.
        "/rerank",
        # vLLM.
        "/v1/chat/completions/batch",
        "/v2/embed",
        "/v2/rerank",
        "/score",
        "/classify",
        "/pooling",
        "/generative_scoring",
        # SGLang.
        "/v1/classify",
        "/v1/tokenize",
        "/v1/detokenize",
        "/v1/decisions",
        # llama.cpp: OpenAI's bodies without the /v1, their input token counts, its rerank aliases.
        "/chat/completions",
        "/responses",
        "/chat/completions/input_tokens",
        "/v1/chat/completions/input_tokens",
        "/responses/input_tokens",
        "/v1/responses/input_tokens",
        "/reranking",
        "/v1/reranking",
    }
)
