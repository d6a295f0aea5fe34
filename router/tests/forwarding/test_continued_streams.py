"""Streams that survive their engine: the bundled mock engine in greedy mode (each token a function of the context)
dies after a few tokens, and the router continues the answer on another replica. The client's stream is compared
byte for byte with the uninterrupted answer of the same request."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_until
from router.tests.conftest import MODEL, make_table
from router.tests.forwarding.test_proxy import metric

pytestmark = pytest.mark.django_db(transaction=True)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GREEDY = ("--greedy",)
# The first replica dies after this many tokens, well inside every answer below.
CUT_AFTER = 7


def request_body(path: str, **extra) -> dict:
    body = {"model": MODEL, "stream": True, "max_tokens": 24, "temperature": 0, **extra}
    if path == CHAT:
        return {"messages": [{"role": "user", "content": "tell me a story"}], **body}
    return {"prompt": "Once upon a time", **body}


def events_of(url: str, path: str, body: dict, headers=None) -> list:
    """The decoded events of a stream (the string "[DONE]" for its end)."""
    events = []
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=20) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def text_of(events: list, path: str) -> str:
    parts = []
    for event in events:
        for choice in event["choices"] if isinstance(event, dict) else ():
            parts.append((choice["delta"].get("content") or "") if path == CHAT else choice["text"])
    return "".join(parts)


@pytest.fixture
def fleet(start_router, hub, engine_process):
    """(router, dying replica, healthy replica): the dying one has the higher priority, so it takes the stream."""

    def start(token_ids: bool, **router_options):
        dying = engine_process(token_delay_ms=2, args=(*GREEDY, "--exit-after-tokens", str(CUT_AFTER)))
        healthy = engine_process(token_delay_ms=2, args=GREEDY)
        models = {MODEL: {"token_ids": token_ids}}
        rows = [{"url": dying.url, "priority": 1}, {"url": healthy.url, "priority": 0}]
        hub.publish_endpoints(make_table(rows, models))
        return start_router(**router_options), dying, healthy

    return start


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("token_ids", [True, False], ids=["token-exact", "text"])
def test_a_stream_whose_engine_dies_is_continued_on_another_replica_byte_for_byte(fleet, auth, path, token_ids):
    router, dying, healthy = fleet(token_ids, flush_seconds=3600)
    body = request_body(path, stream_options={"include_usage": True})
    uninterrupted = events_of(healthy.url, path, body)

    events = events_of(router.url, path, body, auth)

    assert dying.process.wait(5) == 1  # it did die mid-answer
    assert text_of(events, path) == text_of(uninterrupted, path)
    answers = [e for e in events if isinstance(e, dict)]
    assert len({(e["id"], e["created"], e["model"]) for e in answers}) == 1  # one answer, as the first leg named it
    if path == CHAT:
        assert sum("role" in e["choices"][0]["delta"] for e in answers if e["choices"]) == 1
    finishes = [c["finish_reason"] for e in answers for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]
    usage = [e["usage"] for e in answers if e.get("usage")]
    assert usage == [uninterrupted[-2]["usage"]]  # the client's prompt once, every token of both legs
    assert events[-1] == "[DONE]" and not any("error" in e for e in answers)
    assert "token_ids" not in json.dumps(events)  # asked for by the router, not the client
    labels = f'model="{MODEL}",outcome="continued",reason="engine_lost"'
    assert metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}") == 1
    # Counted once for the key, with the client's usage; what the continuation re-read is a figure apart.
    (counts,) = router.state.ledger.tokens.pending()[0].values()
    prompt, completion = usage[0]["prompt_tokens"], usage[0]["completion_tokens"]
    assert counts[MODEL].requests == 1 and (counts[MODEL].prompt, counts[MODEL].completion) == (prompt, completion)
    reread = metric(router, f'llmgw_router_continuation_prompt_tokens_total{{model="{MODEL}"}}')
    assert reread == prompt + CUT_AFTER if token_ids else reread > prompt


def test_the_client_without_usage_gets_none_and_token_ids_it_asked_for_stay(fleet, auth):
    router, _, healthy = fleet(True)
    body = request_body(CHAT, return_token_ids=True)
    uninterrupted = events_of(healthy.url, CHAT, body)
    events = events_of(router.url, CHAT, body, auth)
    assert text_of(events, CHAT) == text_of(uninterrupted, CHAT)
    assert not any(isinstance(e, dict) and e.get("usage") for e in events)
    assert ids_of(events) == ids_of(uninterrupted) and len(ids_of(events)) == 24


def ids_of(events: list) -> list[int]:
    return [i for e in events if isinstance(e, dict) for c in e["choices"] for i in c.get("token_ids") or ()]


def test_a_guided_stream_cut_midway_ends_with_an_error_event_and_is_counted(fleet, auth):
    router, _, _ = fleet(True)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    events = events_of(router.url, CHAT, request_body(CHAT, response_format=schema), auth)
    assert events[-2]["error"]["code"] == "upstream_failed" and events[-1] == "[DONE]"
    assert len(text_of(events[:-2], CHAT).split()) == CUT_AFTER  # what was sent stays: nothing is made up
    labels = f'model="{MODEL}",outcome="guided",reason="engine_lost"'
    assert metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}") == 1


def continuations(router, outcome: str) -> float:
    """How many breaks of a lost engine ended `outcome` (0 before the first)."""
    for family in text_string_to_metric_families(httpx.get(f"{router.url}/metrics").text):
        for sample in family.samples:
            if sample.name == "llmgw_router_stream_continuations_total" and sample.labels == {
                "model": MODEL, "outcome": outcome, "reason": "engine_lost"
            }:  # fmt: skip
                return sample.value
    return 0


def test_a_stream_that_moves_on_with_each_leg_is_carried_to_its_end(start_router, hub, engine_process, auth):
    """LLMGW_STREAM_MIGRATIONS counts continuations that bring no token: engines lost one after another while the
    answer moves on (a fleet losing nodes) do not end it, however many."""
    dying = [engine_process(token_delay_ms=2, args=(*GREEDY, "--exit-after-tokens", str(n))) for n in (5, 4, 3)]
    healthy = engine_process(args=GREEDY)
    rows = [{"url": engine.url, "priority": 3 - i} for i, engine in enumerate(dying)]
    hub.publish_endpoints(make_table([*rows, {"url": healthy.url, "priority": 0}]))
    router = start_router(stream_migrations=1)
    body = request_body(COMPLETIONS)
    events = events_of(router.url, COMPLETIONS, body, auth)
    assert text_of(events, COMPLETIONS) == text_of(events_of(healthy.url, COMPLETIONS, body), COMPLETIONS)
    assert events[-1] == "[DONE]" and not any("error" in e for e in events if isinstance(e, dict))
    # Each break was continued (a dead replica asked again and refusing is one more), none given up.
    assert continuations(router, "continued") >= 3 and continuations(router, "limit") == 0


def test_a_stream_is_given_up_after_the_configured_continuations_in_a_row_that_bring_no_token(
    start_router, hub, engine_process, auth
):
    # The first replica gives 5 tokens; each after it dies once its answer has begun (its role chunk sent), before
    # a token.
    dying = [engine_process(token_delay_ms=2, args=(*GREEDY, "--exit-after-tokens", str(n))) for n in (5, 0, 0, 0)]
    rows = [{"url": engine.url, "priority": 4 - i} for i, engine in enumerate(dying)]
    hub.publish_endpoints(make_table([*rows, {"url": engine_process(args=GREEDY).url, "priority": 0}]))
    router = start_router(stream_migrations=2)
    events = events_of(router.url, CHAT, request_body(CHAT), auth)
    assert len(text_of(events[:-2], CHAT).split()) == 5
    assert events[-2]["error"]["code"] == "upstream_failed"
    # Two fruitless continuations (two engines died), then the third break ended it: the third engine that
    # would have died, and the healthy one, were never asked.
    assert [engine.process.wait(5) for engine in dying[:3]] == [1, 1, 1]  # the router saw each break at its exit
    assert dying[3].process.poll() is None
    assert continuations(router, "limit") == 1


def test_a_model_switched_off_in_the_catalog_is_not_continued(start_router, hub, engine_process, auth):
    dying = engine_process(args=(*GREEDY, "--exit-after-tokens", "3"))
    healthy = engine_process(args=GREEDY)
    rows = [{"url": dying.url, "priority": 1}, {"url": healthy.url, "priority": 0}]
    hub.publish_endpoints(make_table(rows, {MODEL: {"continue_streams": False}}))
    router = start_router()
    events = events_of(router.url, CHAT, request_body(CHAT), auth)
    assert events[-2]["error"]["code"] == "upstream_failed"
    assert len(text_of(events[:-2], CHAT).split()) == 3


def test_each_leg_of_a_continued_stream_is_an_upstream_span_of_its_own(fleet, auth):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    router, _, _ = fleet(True, tracer=provider.get_tracer("router-tests"))
    events_of(router.url, CHAT, request_body(CHAT), auth)
    request = wait_until(lambda: [s for s in exporter.get_finished_spans() if s.name.startswith("POST ")])[0]
    legs = [s for s in exporter.get_finished_spans() if s.name == "upstream"]
    assert [leg.attributes["llmgw.replica"] for leg in legs] == ["1", "2"]
    assert all(leg.parent.span_id == request.context.span_id for leg in legs)
    provider.shutdown()


def test_a_client_that_leaves_while_its_stream_waits_for_a_replica_is_counted_once(
    start_router, hub, engine_process, auth
):
    dying = engine_process(args=(*GREEDY, "--exit-after-tokens", "3"))
    hub.publish_endpoints(make_table([dying.url]))  # no other replica: the continuation waits as for a cold start
    router = start_router(flush_seconds=3600, keepalive_seconds=0.1)
    with httpx.stream("POST", f"{router.url}{CHAT}", json=request_body(CHAT), headers=auth, timeout=10) as response:
        for line in response.iter_lines():
            if line.startswith(":"):  # a keep-alive: the stream waits for another replica; the client leaves
                break
    (counts,) = wait_until(lambda: router.state.ledger.tokens.pending()[0]).values()
    assert counts[MODEL].requests == 1
    time.sleep(0.5)  # and not again later
    (again,) = router.state.ledger.tokens.pending()[0].values()
    assert again[MODEL].requests == 1


@pytest.mark.parametrize("token_ids", [True, False], ids=["token-exact", "text"])
def test_a_stream_its_engine_aborts_for_a_forced_sleep_goes_on_from_another_replica(
    start_router, hub, engine_process, auth, token_ids
):
    """vLLM's sleep (mode=abort) ends the streams in flight with finish_reason "abort" and [DONE]: a well-formed end
    of an unfinished answer, which the router takes as a break, never showing it to the client."""
    sleepy = engine_process(token_delay_ms=30, args=GREEDY, env={"VLLM_SERVER_DEV_MODE": "1"})
    healthy = engine_process(token_delay_ms=2, args=GREEDY)
    rows = [{"url": sleepy.url, "priority": 1}, {"url": healthy.url, "priority": 0}]
    hub.publish_endpoints(make_table(rows, {MODEL: {"token_ids": token_ids}}))
    router = start_router(flush_seconds=3600)
    # 60 tokens at 30 ms: the sleep, asked after 5 words, lands well before the answer ends even on a loaded machine.
    body = request_body(CHAT, stream_options={"include_usage": True}, max_tokens=60)
    events, slept = [], None
    with httpx.stream("POST", router.url + CHAT, json=body, headers=auth, timeout=20) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
            if slept is None and len(text_of(events, CHAT).split()) == 5:
                slept = httpx.post(sleepy.url + "/sleep?level=1&mode=abort", timeout=10)
    assert slept is not None and slept.json() == {"status": "sleeping", "level": 1}
    uninterrupted = events_of(healthy.url, CHAT, body)
    assert text_of(events, CHAT) == text_of(uninterrupted, CHAT)
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"]  # the abort never reached the client
    assert [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")] == [uninterrupted[-2]["usage"]]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    labels = f'model="{MODEL}",outcome="continued",reason="engine_aborted"'
    assert metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}") == 1


def test_an_aborted_stream_with_no_replica_to_go_on_ends_with_the_routers_error_event(
    start_router, hub, engine_process, auth
):
    """With nowhere to go on within the activation limit, the client gets the router's error event naming the
    unfinished end, never the engine's abort as if the answer were done."""
    sleepy = engine_process(token_delay_ms=30, args=GREEDY, env={"VLLM_SERVER_DEV_MODE": "1"})
    hub.publish_endpoints(make_table([sleepy.url]))
    router = start_router(activation_timeout=1.0, keepalive_seconds=0)
    events = []
    with httpx.stream("POST", router.url + CHAT, json=request_body(CHAT), headers=auth, timeout=20) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 3:
                    httpx.post(sleepy.url + "/sleep?level=1&mode=abort", timeout=10)
    assert "ended its answer unfinished" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
    assert not any(c["finish_reason"] for e in events[:-2] for c in e["choices"])
    labels = f'model="{MODEL}",outcome="no_replica",reason="engine_aborted"'
    assert metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}") == 1


def running(url: str) -> float:
    """The requests an engine says it is running (vllm:num_requests_running, summed over its label sets)."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text)
    return sum(s.value for f in families if f.name == "vllm:num_requests_running" for s in f.samples)


def test_a_whole_answer_its_engine_aborts_is_asked_again_of_another_replica(start_router, hub, engine_process, auth):
    """Not streamed, a forced sleep's abort comes back as a 200 with finish_reason "abort" and part of the text:
    nothing reached the client yet, so another replica answers it whole."""
    sleepy = engine_process(token_delay_ms=40, args=GREEDY, env={"VLLM_SERVER_DEV_MODE": "1"})
    healthy = engine_process(args=GREEDY)
    rows = [{"url": sleepy.url, "priority": 1}, {"url": healthy.url, "priority": 0}]
    hub.publish_endpoints(make_table(rows))
    router = start_router(flush_seconds=3600)
    body = {**request_body(CHAT), "stream": False}
    with ThreadPoolExecutor(1) as pool:
        answering = pool.submit(httpx.post, router.url + CHAT, json=body, headers=auth, timeout=20)
        wait_until(lambda: running(sleepy.url) == 1, 10, 0.02)
        httpx.post(sleepy.url + "/sleep?level=1&mode=abort", timeout=10)
        response = answering.result()
    want = httpx.post(healthy.url + CHAT, json=body, timeout=20).json()["choices"][0]
    assert response.status_code == 200
    got = response.json()["choices"][0]
    assert (got["message"]["content"], got["finish_reason"]) == (want["message"]["content"], "length")
    labels = f'model="{MODEL}",outcome="resent_whole",reason="engine_aborted"'
    assert metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}") == 1
    (counts,) = router.state.ledger.tokens.pending()[0].values()  # once for the key: by the replica that answered
    assert counts[MODEL].requests == 1 and counts[MODEL].completion == response.json()["usage"]["completion_tokens"]


def test_the_gap_counted_is_the_clients_pause_from_its_last_chunk_to_the_next_legs_first(
    start_router, hub, engine_process, auth
):
    """An engine that falls silent mid-answer (stopped, not dead) breaks the stream only when the next-chunk
    deadline passes: the client's pause, and the gap counted, include that silence."""
    silent = engine_process(token_delay_ms=20, args=GREEDY)
    healthy = engine_process(token_delay_ms=2, args=GREEDY)
    hub.publish_endpoints(make_table([{"url": silent.url, "priority": 1}, {"url": healthy.url, "priority": 0}]))
    router = start_router(idle_timeout=0.6)
    body = request_body(CHAT, max_tokens=40)
    received, stopped = [], False
    try:
        with httpx.stream("POST", router.url + CHAT, json=body, headers=auth, timeout=20) as response:
            for line in filter(None, response.iter_lines()):
                received.append((time.monotonic(), line))
                if not stopped and len(received) > 10:
                    silent.process.send_signal(signal.SIGSTOP)
                    stopped = True
    finally:
        silent.process.send_signal(signal.SIGCONT)
    pauses = [b[0] - a[0] for a, b in zip(received, received[1:], strict=False)]
    assert max(pauses) >= 0.6 and received[-1][1] == "data: [DONE]"
    series = f'llmgw_router_stream_continuation_gap_seconds_{{}}{{{{model="{MODEL}"}}}}'
    assert metric(router, series.format("count")) == 1
    assert max(pauses) - 0.05 <= metric(router, series.format("sum")) <= max(pauses) + 0.05
