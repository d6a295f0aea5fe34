"""The mock engine's LoRA adapters, as vLLM 0.32 serves them (checked against the real server in tests/e2e/engines/test_vllm.py).

* LoRA is on with `--enable-lora`; `--max-loras N` adapters are held at once (vLLM's default, 1), and
  `--max-lora-rank R` is the largest rank taken (vLLM's default, 16).
* With VLLM_ALLOW_RUNTIME_LORA_UPDATING true (as vLLM reads it: `1` or `true`) the engine serves
  `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`,
  answered 200 with vLLM's line of text; without it the routes do not exist (404), and without
  `--enable-lora` a load fails as vLLM's does (500 "LoRA is not enabled."). The errors are vLLM's, in its
  shape (`{"error": {"message", "type", "param", "code"}}`): 400 for a name already loaded, 404 for a
  `lora_path` that is a local folder not there ("Loading lora x failed: No adapter found for …"; a hub id,
  not starting with `/`, `.` or `~`, is taken as found), 400 for a folder whose adapter_config.json has a
  rank above the largest, 404 for unloading a name not held.
* A load takes `--lora-load-seconds` (default 0), as reading and placing an adapter's weights does, so
  benches can give it the time a real one takes. One name loads at a time, as in vLLM.
* Where vLLM differs: when its `--max-loras` GPU slots are full, vLLM evicts from its adapter cache and
  reloads on demand. The mock refuses instead (500, naming the adapters it holds), so a control plane that
  asks an engine for more adapters than its slots shows, rather than paying for hidden reloads.
* Held adapters are listed by `GET /v1/models` as vLLM lists them (`id` = the adapter's name, `parent` = the
  served model, `root` = its path), and answer chat and completions under their own name.
* `/metrics` gains vLLM's `vllm:lora_requests_info` gauge (labels `max_lora`, `waiting_lora_adapters`,
  `running_lora_adapters`: the names with requests running, comma-separated; the value, when it was set).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from aiohttp import web

from mockengine.text import BadRequest
from nodewire.engine_env import VLLM_RUNTIME_LORA_ENV

VLLM_DEFAULT_MAX_LORAS = 1
VLLM_DEFAULT_MAX_LORA_RANK = 16


def runtime_updates_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether VLLM_ALLOW_RUNTIME_LORA_UPDATING switches the load routes on, as vLLM reads it."""
    return environ.get(VLLM_RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


def vllm_error(status: int, message: str, kind: str) -> web.Response:
    """An error in vLLM's own shape: the type names the error class, the code is the HTTP status."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


class MockLoRA:
    """The adapters one mock engine holds, and vLLM's routes that load and unload them."""

    def __init__(
        self,
        enabled: bool = False,
        max_loras: int | None = None,
        max_rank: int | None = None,
        load_seconds: float = 0.0,
    ):
        self.enabled = enabled
        self.max_loras = max_loras or VLLM_DEFAULT_MAX_LORAS
        self.max_rank = max_rank or VLLM_DEFAULT_MAX_LORA_RANK
        self.load_seconds = load_seconds
        # Name -> path, in the order loaded; names loading now hold a slot too.
        self.held: dict[str, str] = {}
        self.loading: set[str] = set()
        self.running: collections.Counter[str] = collections.Counter()
        self._locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)

    async def load(self, request: web.Request) -> web.Response:
        name, path = await _fields(request, "lora_name", "lora_path")
        if not name or not path:
            return vllm_error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        async with self._locks[name]:
            if name in self.held:
                message = (
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                    "set 'load_inplace' to True."
                )
                return vllm_error(400, message, "InvalidUserInput")
            if (refused := self._cannot_load(name, path)) is not None:
                return refused
            self.loading.add(name)
            try:
                await asyncio.sleep(self.load_seconds)
            finally:
                self.loading.discard(name)
            self.held[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    def _cannot_load(self, name: str, path: str) -> web.Response | None:
        """vLLM's answer to a load that fails before it reads any weight, or None."""
        if not self.enabled:
            return vllm_error(500, "LoRA is not enabled.", "InternalServerError")
        if len(self.held) + len(self.loading) >= self.max_loras:
            holding = ", ".join([*self.held, *sorted(self.loading)])
            message = (
                f"Cannot load LoRA adapter '{name}': all {self.max_loras} --max-loras slots hold adapters "
                f"({holding}); unload one first"
            )
            return vllm_error(500, message, "InternalServerError")
        if path.startswith(("/", ".", "~")):
            folder = Path(path).expanduser()
            if not folder.is_dir():
                return vllm_error(404, f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError")
            rank = _rank(folder)
            if rank is not None and rank > self.max_rank:
                message = f"LoRA rank {rank} is greater than max_lora_rank {self.max_rank}."
                return vllm_error(400, message, "BadRequestError")
        return None

    async def unload(self, request: web.Request) -> web.Response:
        (name,) = await _fields(request, "lora_name")
        if not name:
            message = "'lora_name' needs to be provided to unload a LoRA adapter."
            return vllm_error(400, message, "InvalidUserInput")
        async with self._locks[name]:
            if name not in self.held:
                return vllm_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            del self.held[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    def model_cards(self, base: str) -> list[dict]:
        """The held adapters as `GET /v1/models` lists them."""
        return [
            {"id": name, "object": "model", "created": 0, "owned_by": "llmgw-mock", "root": path, "parent": base}
            for name, path in self.held.items()
        ]

    def metric_lines(self) -> list[str]:
        """vLLM's LoRA gauge, only when LoRA is on (as vLLM registers it)."""
        if not self.enabled:
            return []
        name = "vllm:lora_requests_info"
        running = ",".join(adapter for adapter, count in self.running.items() if count > 0)
        # In vLLM's order; nothing waits in the mock.
        labels = f'max_lora="{self.max_loras}",waiting_lora_adapters="",running_lora_adapters="{running}"'
        return [
            f"# HELP {name} Running stats on lora requests.",
            f"# TYPE {name} gauge",
            f"{name}{{{labels}}} {time.time()}",
        ]


async def _fields(request: web.Request, *names: str) -> list[str]:
    """The string fields `names` of a JSON body (empty when absent); BadRequest for a body that is not one."""
    try:
        body = await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    values = []
    for name in names:
        value = body.get(name, "")
        if not isinstance(value, str):
            raise BadRequest(f"field “{name}” must be a string", name)
        values.append(value)
    return values


def _rank(folder: Path) -> int | None:
    """The rank `r` in a PEFT adapter's adapter_config.json, or None when it cannot be read."""
    try:
        rank = json.loads((folder / "adapter_config.json").read_text()).get("r")
    except (OSError, ValueError, AttributeError):
        return None
    return rank if isinstance(rank, int) and not isinstance(rank, bool) else None
