"""The adapter calls of each engine dialect (agent/engines/adapters.py), against a recording HTTP server on 127.0.0.1
that answers as the engine would, by its source (the mock engine is driven in test_agent_adapters.py, the real
vLLM's routes in tests/e2e/engines/test_vllm.py)."""

import json

import httpx
import pytest

from agent.engines.adapters import EngineAdapterError, EngineAdapters, engine_words
from agent.tests.engines.test_sleep import Recorder, engine
from agent.tests.stand_ins import run

VLLM_ALREADY = json.dumps({"error": {"message": "The lora adapter 'a' has already been loaded. If you want to load "
                                                "the adapter in place, set 'load_inplace' to True.",
                                     "type": "InvalidUserInput", "param": None, "code": 400}})  # fmt: skip
VLLM_NOT_HELD = json.dumps({"error": {"message": "The lora adapter 'a' cannot be found.", "type": "NotFoundError",
                                      "param": None, "code": 404}})  # fmt: skip
SGLANG_ALREADY = json.dumps({"success": False, "error_message": "Failed to load LoRA adapter a because it is already "
                             "loaded", "loaded_adapters": {"a": "/x"}})  # fmt: skip
SGLANG_NOT_HELD = json.dumps({"success": False, "error_message": "LoRA with name a does not exist. Loaded LoRAs: "
                              "dict_keys([])", "loaded_adapters": {}})  # fmt: skip


def calls(dialect: str, answers: dict, *steps: tuple) -> tuple[list, list[str]]:
    """Run `steps` ((verb, args) pairs) against a stand-in answering `answers`; their results and the calls made."""
    recorder = Recorder(answers)

    async def scenario():
        results = []
        async with engine(recorder) as (client, url):
            adapters = EngineAdapters(client, url, dialect)
            for verb, *args in steps:
                try:
                    results.append(await getattr(adapters, verb)(*args))
                except EngineAdapterError as exc:
                    results.append(str(exc))
        return results

    return run(scenario()), recorder.calls


def test_vllm_loads_and_unloads_with_its_routes_and_payloads():
    results, made = calls("vllm", {}, ("load", "a", "/adapters/a"), ("unload", "a"))
    assert results == [True, True]
    assert made == [
        'POST /v1/load_lora_adapter {"lora_name":"a","lora_path":"/adapters/a"}',
        'POST /v1/unload_lora_adapter {"lora_name":"a"}',
    ]


def test_vllms_already_loaded_and_not_held_reach_the_goal_and_other_errors_fail_with_its_words():
    answers = {"/v1/load_lora_adapter": (400, VLLM_ALREADY), "/v1/unload_lora_adapter": (404, VLLM_NOT_HELD)}
    assert calls("vllm", answers, ("load", "a", "org/a"), ("unload", "a"))[0] == [False, False]
    # Without VLLM_ALLOW_RUNTIME_LORA_UPDATING the routes do not exist: a 404 that is no "not held".
    answers = {"/v1/unload_lora_adapter": (404, '{"detail":"Not Found"}')}
    assert calls("vllm", answers, ("unload", "a"))[0] == ["POST /v1/unload_lora_adapter answered HTTP 404: Not Found"]
    error = json.dumps({"error": {"message": "LoRA rank 64 is greater than max_lora_rank 16.", "code": 400}})
    assert calls("vllm", {"/v1/load_lora_adapter": (400, error)}, ("load", "a", "org/a"))[0] == [
        "POST /v1/load_lora_adapter answered HTTP 400: LoRA rank 64 is greater than max_lora_rank 16."
    ]


def test_sglang_has_its_own_routes_and_words():
    results, made = calls("sglang", {}, ("load", "a", "/adapters/a"), ("unload", "a"))
    assert results == [True, True]
    assert made == [
        'POST /load_lora_adapter {"lora_name":"a","lora_path":"/adapters/a"}',
        'POST /unload_lora_adapter {"lora_name":"a"}',
    ]
    answers = {"/load_lora_adapter": (400, SGLANG_ALREADY), "/unload_lora_adapter": (400, SGLANG_NOT_HELD)}
    assert calls("sglang", answers, ("load", "a", "org/a"), ("unload", "a"))[0] == [False, False]
    not_enabled = json.dumps({"success": False, "error_message": "LoRA is not enabled. Please set `--enable-lora`."})
    assert calls("sglang", {"/load_lora_adapter": (400, not_enabled)}, ("load", "a", "org/a"))[0] == [
        "POST /load_lora_adapter answered HTTP 400: LoRA is not enabled. Please set `--enable-lora`."
    ]


def test_a_follower_asks_nothing_and_an_engine_not_answering_fails_naming_the_call():
    results, made = calls("follower", {}, ("load", "a", "org/a"), ("unload", "a"))
    assert (results, made) == ([True, True], [])

    async def unreachable():
        async with httpx.AsyncClient(trust_env=False) as client:
            with pytest.raises(EngineAdapterError, match=r"^POST /v1/load_lora_adapter failed: "):
                await EngineAdapters(client, "http://127.0.0.1:9", "vllm").load("a", "org/a")

    run(unreachable())
    with pytest.raises(ValueError, match="unknown adapter dialect 'llamacpp'"):
        EngineAdapters(None, "http://x", "llamacpp")  # type: ignore[arg-type]


def test_an_engines_long_answer_is_cut_to_a_status_messages_length():
    words = engine_words(httpx.Response(500, text="x" * 1000))
    assert len(words) == 301 and words.endswith("…")
