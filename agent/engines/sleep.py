"""Asking one engine to sleep and to wake, in its own dialect (agent/engines/launch.py chose it at launch).

* `vllm` (vLLM 0.32 with VLLM_SERVER_DEV_MODE=1, and the mock engine imitating it): `POST
  /sleep?level=N&mode=M`, confirmed by `GET /is_sleeping` → `{"is_sleeping": true}`. vLLM's default mode,
  `abort`, ends the requests in flight; `wait` lets them finish first. agent/hibernation.py waits for them
  itself (it can report what it waits for, and give up at the drain's timeout), then sleeps with `wait`, so
  a request that slipped in meanwhile is not cut, or with `abort` once the timeout has passed. A sleep
  pauses vLLM's scheduler (requests that arrive are queued, not run) and, at levels 1 and 2, resets the
  prefix cache itself before it frees the memory.

  Waking is `POST /wake_up`, which answers `{"status": "awake" | "sleeping", "tags": …}`: vLLM resumes
  scheduling in the same call that makes the last of its memory (`weights`, `kv_cache`) resident again,
  and `/is_sleeping` stays true until then. After level 1 the weights come back from host memory in that
  one call, before scheduling resumes, so a tagless wake is right. After level 2 the weights were
  discarded: a tagless wake would run the queued requests on memory that holds no weights before any
  reload could follow. So the wake goes by parts: `?tags=weights` (answered `sleeping`: the weights'
  memory is back, still paused), the weights reloaded into it in place (`POST /collective_rpc
  {"method": "reload_weights"}`, which needs that memory mapped), the prefix cache reset (`POST
  /reset_prefix_cache`: the sleep emptied it already, and this confirms that nothing refers to the discarded
  KV cache before anything runs; it is the scheduler's bookkeeping, so it works while paused. Its
  `{"success": false}` means blocks are still held, but the sleep freed them all and a paused scheduler
  takes no new ones: a failure, not something to wait out), and last `?tags=kv_cache`, answered `awake`,
  which resumes scheduling.
  Awake is confirmed by `/is_sleeping` and then `/health`.
* `sglang` (with `--enable-memory-saver --enable-weights-cpu-backup`): `POST /release_memory_occupation {}`
  and `POST /resume_memory_occupation {}`, then `/health`. SGLang has no route that says whether it sleeps:
  its answers are the confirmation. Level 1 only (the weights wait in host memory).
* `follower`: a rank above 0 of a replica across nodes serves no HTTP; its head's sleep reaches its workers,
  so there is nothing to ask it.

Each step that fails raises EngineSleepError naming the call and what the engine answered.
"""

from __future__ import annotations

import httpx

from agent.engines.answers import json_field, shown

DIALECTS = ("vllm", "sglang", "follower")
# The levels each dialect can sleep at.
LEVELS: dict[str, tuple[int, ...]] = {"vllm": (1, 2), "sglang": (1,), "follower": (1, 2)}
# Sleeping copies (level 1) or frees (level 2) every weight; waking reloads them: minutes for the largest models.
CALL_TIMEOUT_SECONDS = 600.0


class EngineSleepError(Exception):
    """An engine did not sleep or wake as asked; the text names the call and the engine's answer."""


def level_problem(dialect: str, level: int) -> str | None:
    """Why an engine of `dialect` cannot sleep at `level`, or None."""
    if level not in LEVELS[dialect]:
        allowed = " or ".join(str(n) for n in LEVELS[dialect])
        return f"a {dialect} engine sleeps at level {allowed} only, not level {level}"
    return None


class EngineSleep:
    """The sleep and wake calls for one engine at `base_url` (scheme, host and port) in `dialect`."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, dialect: str):
        if dialect not in DIALECTS:
            raise ValueError(f"unknown sleep dialect {dialect!r}; expected one of {', '.join(DIALECTS)}")
        self._client = client
        self._base = base_url.rstrip("/")
        self.dialect = dialect

    async def sleep(self, level: int, cut_in_flight: bool = False) -> None:
        """Put the engine to sleep at `level` and confirm it sleeps; requests still in flight finish first,
        or, with `cut_in_flight`, are ended (vLLM; SGLang has no such choice)."""
        if self.dialect == "vllm":
            mode = "abort" if cut_in_flight else "wait"
            await self._call("POST", "/sleep", params={"level": str(level), "mode": mode})
            if not await self.is_sleeping():
                raise EngineSleepError(f"the engine answered POST /sleep?level={level} but says it is not sleeping")
        elif self.dialect == "sglang":
            await self._call("POST", "/release_memory_occupation", json={})

    async def wake(self, level: int) -> None:
        """Wake the engine from a sleep at `level`, reload what that level discarded, and confirm it serves."""
        if self.dialect == "follower":
            return
        if self.dialect == "sglang":
            await self._call("POST", "/resume_memory_occupation", json={})
        else:
            if level == 2:
                await self._wake_reloading()
            else:
                await self._wake_up(None, "awake")
            if await self.is_sleeping():
                raise EngineSleepError("the engine answered POST /wake_up but says it is still sleeping")
        await self._call("GET", "/health")

    async def _wake_reloading(self) -> None:
        """vLLM after level 2: the weights' memory back, the weights reloaded into it and the prefix cache reset
        while scheduling is still paused; then the KV cache, whose wake resumes scheduling."""
        await self._wake_up("weights", "sleeping")
        await self._call("POST", "/collective_rpc", json={"method": "reload_weights"})
        reset = await self._call("POST", "/reset_prefix_cache")
        if json_field(reset, "success") is not True:
            raise EngineSleepError(f"POST /reset_prefix_cache answered {shown(reset.text)!r}, not success true")
        await self._wake_up("kv_cache", "awake")

    async def _wake_up(self, tag: str | None, status: str) -> None:
        """`POST /wake_up` for `tag` (None: everything), confirming the `status` vLLM answers with."""
        if tag is None:
            answer, path = await self._call("POST", "/wake_up"), "POST /wake_up"
        else:
            answer, path = await self._call("POST", "/wake_up", params={"tags": tag}), f"POST /wake_up?tags={tag}"
        if json_field(answer, "status") != status:
            paused = " (scheduling must stay paused until the weights are reloaded)" if status == "sleeping" else ""
            raise EngineSleepError(f"{path} answered {shown(answer.text)!r}, not status {status!r}{paused}")

    async def is_sleeping(self) -> bool:
        """vLLM's own word on whether it sleeps (`GET /is_sleeping`)."""
        answer = await self._call("GET", "/is_sleeping")
        try:
            sleeping = answer.json()["is_sleeping"]
        except (ValueError, KeyError, TypeError):
            sleeping = None
        if not isinstance(sleeping, bool):
            raise EngineSleepError(f"GET /is_sleeping answered {shown(answer.text)!r}, not {{'is_sleeping': bool}}")
        return sleeping

    async def _call(self, method: str, path: str, **kwargs) -> httpx.Response:
        query = "?" + "&".join(f"{k}={v}" for k, v in kwargs.get("params", {}).items()) if "params" in kwargs else ""
        try:
            answer = await self._client.request(method, self._base + path, timeout=CALL_TIMEOUT_SECONDS, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineSleepError(f"{method} {path}{query} failed: {exc or type(exc).__name__}") from None
        if answer.status_code != 200:
            raise EngineSleepError(f"{method} {path}{query} answered HTTP {answer.status_code}: {shown(answer.text)}")
        return answer
