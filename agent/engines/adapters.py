"""Asking one engine to load and unload a LoRA adapter, in its own dialect (agent/engines/launch.py chose it at launch).

* `vllm` (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true and `--enable-lora`, and the mock engine imitating it):
  `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`,
  answered 200 with a line of text. A name it holds already is refused with 400 "The lora adapter 'x' has
  already been loaded…"; unloading one it does not hold, with 404 "The lora adapter 'x' cannot be found.".
  Other failures are vLLM's error shape, `{"error": {"message", "type", "code"}}` (a path not found: 404
  "Loading lora x failed: No adapter found for …"; an engine error: 500).
* `sglang` (with `--enable-lora`): `POST /load_lora_adapter` and `POST /unload_lora_adapter`, the same
  field names, answered `{"success", "error_message", "loaded_adapters"}`, 400 when it failed: "Failed to load
  LoRA adapter x because it is already loaded" and "LoRA with name x does not exist. …" on an unload.
* `follower`: a rank above 0 of a replica across nodes serves no HTTP; its head's load reaches its workers,
  so there is nothing to ask it.

A name the engine holds already counts as loaded, and one it does not hold as unloaded: either way the goal is
reached. Anything else raises EngineAdapterError naming the call and what the engine answered.
"""

from __future__ import annotations

import httpx

from agent.engines.answers import json_field, shown

DIALECTS = ("vllm", "sglang", "follower")
# Loading from the hub downloads the adapter first.
CALL_TIMEOUT_SECONDS = 600.0
_ROUTES = {"vllm": "/v1/{verb}_lora_adapter", "sglang": "/{verb}_lora_adapter"}
# The engine's words for "the goal is reached already", by dialect and verb: (status, words in its message).
_ALREADY = {
    ("vllm", "load"): (400, ("has already been loaded",)),
    ("vllm", "unload"): (404, ("cannot be found",)),
    ("sglang", "load"): (400, ("already loaded", "already exists")),
    ("sglang", "unload"): (400, ("does not exist",)),
}


class EngineAdapterError(Exception):
    """An engine did not load or unload an adapter as asked; the text names the call and the engine's answer."""


class EngineAdapters:
    """The adapter calls for one engine at `base_url` (scheme, host and port) in `dialect`."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, dialect: str):
        if dialect not in DIALECTS:
            raise ValueError(f"unknown adapter dialect {dialect!r}; expected one of {', '.join(DIALECTS)}")
        self._client = client
        self._base = base_url.rstrip("/")
        self.dialect = dialect

    async def load(self, name: str, source: str) -> bool:
        """Load `source` under `name`; False when the engine held that name already (it still holds it)."""
        return await self._call("load", {"lora_name": name, "lora_path": source})

    async def unload(self, name: str) -> bool:
        """Unload `name`; False when the engine did not hold it."""
        return await self._call("unload", {"lora_name": name})

    async def _call(self, verb: str, body: dict[str, str]) -> bool:
        if self.dialect == "follower":
            return True
        path = _ROUTES[self.dialect].format(verb=verb)
        try:
            answer = await self._client.post(self._base + path, json=body, timeout=CALL_TIMEOUT_SECONDS)
        except httpx.HTTPError as exc:
            raise EngineAdapterError(f"POST {path} failed: {exc or type(exc).__name__}") from None
        if answer.status_code == 200:
            if self.dialect == "sglang" and json_field(answer, "success") is False:
                raise EngineAdapterError(f"POST {path} answered 200 but failed: {engine_words(answer)}")
            return True
        words = engine_words(answer)
        status, phrases = _ALREADY[(self.dialect, verb)]
        if answer.status_code == status and any(phrase in words for phrase in phrases):
            return False
        raise EngineAdapterError(f"POST {path} answered HTTP {answer.status_code}: {words}")


def engine_words(answer: httpx.Response) -> str:
    """What an engine said in its answer, cut to a length a status message can carry: vLLM's (OpenAI's) error
    message, SGLang's `error_message`, FastAPI's `detail`, or else the text as it came."""
    error = json_field(answer, "error")
    words = error.get("message") if isinstance(error, dict) else None
    for field in ("error_message", "detail"):
        if not isinstance(words, str) or not words:
            words = json_field(answer, field)
    return shown(words if isinstance(words, str) and words else answer.text)
