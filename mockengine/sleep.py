"""When the mock engine may answer: loading, awake, asleep, and after a level-2 sleep how, as vLLM 0.32 behaves.

* Loading: from launch until `--load-seconds` have passed, `/health` answers 503 and requests are held (a
  cold start, for benches of swaps).
* Sleep, with VLLM_SERVER_DEV_MODE=1 only, as vLLM serves its development routes: `POST /sleep?level=N`
  (1 or 2, default 1; `{"status": "sleeping", "level": N}`) ends the requests in flight (`mode=abort`,
  vLLM's default) or first waits for them to finish (`mode=wait`), empties the prefix cache, and holds new
  requests, neither running nor waiting in the gauges, until the engine is fully awake. Its two memory
  pools, `weights` and `kv_cache`, sleep together; `POST /wake_up` wakes both, or with `?tags=weights` or
  `?tags=kv_cache` one, after `--wake-seconds` when the weights come back. It answers `{"status": "awake"}`
  once neither sleeps, and only then are the held requests run (the status is `"sleeping"` before). As in
  vLLM, a wake naming a tag that is not asleep (an unknown one, or one woken already) wakes nothing and is
  no error, and `scheduling` is left out (vLLM's level 0, which only pauses, is not imitated, nor is `mode=keep`).
  `GET /is_sleeping` answers `{"is_sleeping": bool}`: true until fully awake. Sleeping again while asleep
  changes nothing, as in vLLM.
* Level 2 discarded the weights: `POST /collective_rpc {"method": "reload_weights"}` reloads them, which
  fails (HTTP 500) while the `weights` pool still sleeps, as writing into unmapped GPU memory would. A
  request run before the reload (vLLM resumes on any full wake, reloaded or not) answers with its every
  word NO_WEIGHTS, where vLLM would answer garbage from whatever that memory holds: a wrong wake order
  shows. `POST /reset_prefix_cache` answers `{"success": bool}`: false, emptying nothing, while requests
  run (their KV blocks are held), as vLLM's.
* `vllm:engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}`: 1 for the state it is in.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable

from aiohttp import web

from mockengine.text import ENGINE, BadRequest, openai_error

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # sleep level 0, 1, 2
# vLLM's memory pools that sleep and wake (vllm/v1/executor/abstract.py, SLEEP_TAGS).
SLEEP_TAGS = frozenset(("weights", "kv_cache"))
# Each word of an answer computed before a level-2 sleep's discarded weights were reloaded.
NO_WEIGHTS = "<no-weights>"


def seconds_since_launch() -> float:
    """How long ago this process was started (Linux's /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            # The fields after the command name (which may hold spaces) start at the state, field 3.
            started = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
            return max(0.0, float(uptime.read().split()[0]) - started)
    except (OSError, ValueError, IndexError):
        return 0.0


class MockSleep:
    """The mock engine's loading and sleep state, and vLLM's sleep routes over it."""

    def __init__(self, load_seconds: float = 0.0, wake_seconds: float = 0.0):
        self.load_seconds = load_seconds
        self.wake_seconds = wake_seconds
        self.loaded = load_seconds <= 0
        # The level of the sleep, until fully awake again (the gauge's state).
        self.level = 0
        self.asleep: set[str] = set()
        # From a level-2 sleep until reload_weights.
        self.weights_discarded = False
        # While a sleep with mode=wait waits for the requests in flight.
        self._paused = False
        # Bumped by each sleep: a request started under an older one was in flight when the engine slept.
        self.generation = 0
        self._serving = asyncio.Event()
        self._update()
        # What POST /reset_prefix_cache empties (mockengine/prefix_cache.py), given by the app.
        self.on_reset_prefix_cache: Callable[[], None] | None = None

    @property
    def serving(self) -> bool:
        return self.loaded and not self.asleep and not self._paused

    def _update(self) -> None:
        if self.serving:
            self._serving.set()
        else:
            self._serving.clear()

    async def hold(self) -> int:
        """Wait until the engine may answer; return the sleep generation the request runs under."""
        while not self.serving:
            await self._serving.wait()
        return self.generation

    def aborted(self, generation: int) -> bool:
        """Whether a request that began under `generation` was cut by a sleep since."""
        return generation != self.generation

    async def load(self, app: web.Application) -> None:
        """On start-up: become healthy after the load time (a background task, so the port answers at once)."""
        if not self.loaded:
            app["loading"] = asyncio.create_task(self._finish_loading())

    async def _finish_loading(self) -> None:
        # Counted from the process's launch, as an engine's cold start is, not from when this server began.
        await asyncio.sleep(max(0.0, self.load_seconds - seconds_since_launch()))
        self.loaded = True
        self._update()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/sleep", self.sleep)
        app.router.add_post("/wake_up", self.wake_up)
        app.router.add_get("/is_sleeping", self.is_sleeping)
        app.router.add_post("/collective_rpc", self.collective_rpc)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)

    async def sleep(self, request: web.Request):
        text = request.query.get("level", "1")
        if text not in ("1", "2"):
            raise BadRequest(f"sleep level must be 1 or 2, got {text!r}", "level")
        mode = request.query.get("mode", "abort")
        if mode not in ("abort", "wait"):
            raise BadRequest(f"sleep mode must be abort or wait, got {mode!r}", "mode")
        if mode == "wait":
            # New requests are held from now on; those in flight finish first.
            self._paused = True
            self._update()
            while request.app[ENGINE].running:
                await asyncio.sleep(0.01)
            self._paused = False
        if "weights" not in self.asleep:
            self.level, self.asleep = int(text), set(SLEEP_TAGS)
            self.weights_discarded = self.weights_discarded or self.level == 2
            self.generation += 1
            self._update()
            # vLLM's sleep (level 1 or 2) resets the prefix cache before it frees the memory.
            if self.on_reset_prefix_cache is not None:
                self.on_reset_prefix_cache()
        return web.json_response({"status": "sleeping", "level": int(text)})

    async def wake_up(self, request: web.Request):
        named = request.query.getall("tags", [])
        tags = set(named) - {"scheduling"} if named else set(self.asleep)
        # As vLLM's executor: nothing is woken unless every tag named sleeps.
        if tags and tags <= self.asleep:
            if "weights" in tags and self.wake_seconds:
                await asyncio.sleep(self.wake_seconds)
            self.asleep -= tags
            self.level = self.level if self.asleep else 0
            self._update()
        return web.json_response({"status": "sleeping" if self.asleep else "awake", "tags": named or None})

    async def is_sleeping(self, request: web.Request):
        return web.json_response({"is_sleeping": bool(self.asleep)})

    async def collective_rpc(self, request: web.Request):
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BadRequest("the request body is not valid JSON") from None
        method = body.get("method") if isinstance(body, dict) else None
        if not isinstance(method, str) or not method:
            raise BadRequest("field “method” is required and must be a string", "method")
        if method == "reload_weights":
            if "weights" in self.asleep:
                return openai_error(500, "reload_weights: the weights' memory sleeps; wake it (tags=weights) first",
                                    kind="InternalServerError")  # fmt: skip
            self.weights_discarded = False
        return web.json_response({"results": [None]})

    async def reset_prefix_cache(self, request: web.Request):
        success = request.app[ENGINE].running == 0
        if success and self.on_reset_prefix_cache is not None:
            self.on_reset_prefix_cache()
        return web.json_response({"success": success})

    def metric_lines(self, label: str) -> list[str]:
        """vLLM's sleep-state gauge; `label` is the engine's `{engine=…,model_name=…}` set, braces included."""
        name = "vllm:engine_sleep_state"
        lines = [f"# HELP {name} Engine sleep state; awake = 0 means engine is sleeping.", f"# TYPE {name} gauge"]
        for level, state in enumerate(SLEEP_STATES):
            lines.append(f'{name}{label[:-1]},sleep_state="{state}"}} {1.0 if self.level == level else 0.0}')
        return lines
