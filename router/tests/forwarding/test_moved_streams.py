"""Streams moved off a replica leaving service, end to end: the router gets a table naming the replica among those
to move, cuts what it relays from it between two chunks and goes on with it on another replica; the engine is left
idle (so its drain ends as drained, nothing cut), and a stream that could not be continued is left to finish there."""

from __future__ import annotations

import json
import time

import httpx
import msgspec
import pytest

from conftest import wait_until
from router.tests.conftest import MODEL, make_table
from router.tests.forwarding.test_continued_streams import CHAT, GREEDY, events_of, request_body, running, text_of
from router.tests.forwarding.test_proxy import metric

pytestmark = pytest.mark.django_db(transaction=True)


def stream_while(router, body, auth, when_words: int, action) -> list:
    """The events of a stream through `router`; `action()` runs once the client has `when_words` words."""
    events, acted = [], False
    with httpx.stream("POST", router.url + CHAT, json=body, headers=auth, timeout=20) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
            if not acted and len(text_of(events, CHAT).split()) >= when_words:
                action()
                acted = True
    return events


@pytest.fixture
def leaving_fleet(start_router, hub, engine_process):
    """(router, publish the table moving replica 1 at `when`, the leaving engine, the staying one)."""

    def start(token_ids: bool):
        leaving = engine_process(token_delay_ms=40, args=GREEDY)
        staying = engine_process(token_delay_ms=2, args=GREEDY)
        models = {MODEL: {"token_ids": token_ids}}
        hub.publish_endpoints(make_table([{"url": leaving.url, "priority": 1}, staying.url], models))
        router = start_router(flush_seconds=3600)

        def leave(when: float) -> None:
            # As the control plane publishes it: replica 1 unpublished, and when its streams move.
            table = make_table([{"url": staying.url, "replica_id": "2"}], models)
            hub.publish_endpoints(msgspec.structs.replace(table, moving={"1": when}))

        return router, leave, leaving, staying

    return start


@pytest.mark.parametrize("token_ids", [True, False], ids=["token-exact", "text"])
def test_a_stream_on_a_replica_leaving_service_goes_on_from_another_and_its_engine_is_left_idle(
    leaving_fleet, auth, token_ids
):
    router, leave, leaving, staying = leaving_fleet(token_ids)
    body = request_body(CHAT, max_tokens=60, stream_options={"include_usage": True})
    uninterrupted = events_of(staying.url, CHAT, body)

    events = stream_while(router, body, auth, 5, lambda: leave(time.time()))

    assert text_of(events, CHAT) == text_of(uninterrupted, CHAT)
    finishes = [c["finish_reason"] for e in events if isinstance(e, dict) for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["length"] and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")] == [uninterrupted[-2]["usage"]]
    labels = f'model="{MODEL}",outcome="continued",reason="replica_leaving"'
    assert metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}") == 1
    # Moved, not killed: the engine is alive and holds nothing, so a drain finds it idle.
    assert leaving.process.poll() is None
    wait_until(lambda: running(leaving.url) == 0, 5, 0.05)


def test_a_move_waits_for_the_time_the_table_names(leaving_fleet, auth):
    router, leave, _, staying = leaving_fleet(True)
    body = request_body(CHAT, max_tokens=60)
    moved_at: list[float] = []
    events, stamps = [], []
    with httpx.stream("POST", router.url + CHAT, json=body, headers=auth, timeout=20) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
                stamps.append(time.time())
                if len(events) == 3:
                    moved_at.append(time.time() + 1.0)
                    leave(moved_at[0])
    assert text_of(events, CHAT) == text_of(events_of(staying.url, CHAT, body), CHAT)
    # Until the move, chunks came at the leaving engine's pace (40 ms a token); then the rest from the other.
    before = [b - a for a, b in zip(stamps, stamps[1:], strict=False) if b <= moved_at[0]]
    assert len(before) >= 15 and sorted(before)[len(before) // 2] > 0.03
    assert stamps[-1] - moved_at[0] < 1.0
    labels = f'model="{MODEL}",outcome="continued",reason="replica_leaving"'
    assert metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}") == 1


def test_a_stream_that_could_not_be_continued_is_left_to_finish_on_its_replica(leaving_fleet, auth):
    router, leave, leaving, _ = leaving_fleet(True)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    body = request_body(CHAT, max_tokens=30, response_format=schema)
    own = events_of(leaving.url, CHAT, body)

    events = stream_while(router, body, auth, 5, lambda: leave(time.time()))

    assert text_of(events, CHAT) == text_of(own, CHAT)  # all of it from the replica that began it
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    assert "llmgw_router_stream_continuations_total{" not in httpx.get(f"{router.url}/metrics").text


def test_a_stream_that_used_its_continuations_on_a_failing_engine_still_moves_off_a_leaving_replica(
    start_router, hub, engine_process, auth
):
    """LLMGW_STREAM_MIGRATIONS bounds what failing engines cost: a drain is no failure, so a move needs no leg left.
    The stream is moved off the leaving replica before that leg's first token: the one continuation it may make
    without a token coming back is spent."""
    dying = engine_process(token_delay_ms=2, args=(*GREEDY, "--exit-after-tokens", "3"))
    leaving = engine_process(token_delay_ms=1500, args=GREEDY)
    staying = engine_process(token_delay_ms=2, args=GREEDY)
    models = {MODEL: {"token_ids": False}}  # a chat continuation: the leaving engine's role chunk, then silence
    rows = [{"url": dying.url, "priority": 2}, {"url": leaving.url, "priority": 1}, staying.url]
    hub.publish_endpoints(make_table(rows, models))
    router = start_router(flush_seconds=3600, stream_migrations=1)
    body = request_body(CHAT, max_tokens=60)
    uninterrupted = events_of(staying.url, CHAT, body)

    def leave() -> None:
        wait_until(lambda: metric_or_none(router, "engine_lost"))  # the stream is on the leaving replica
        table = make_table([{"url": staying.url, "replica_id": "3"}], models)
        hub.publish_endpoints(msgspec.structs.replace(table, moving={"2": time.time()}))

    began = time.monotonic()
    events = stream_while(router, body, auth, 3, leave)  # the dying engine's 3 tokens: then on the leaving one

    assert time.monotonic() - began < 1.5  # moved before the leaving engine gave a token
    assert text_of(events, CHAT) == text_of(uninterrupted, CHAT)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
    for reason in ("engine_lost", "replica_leaving"):
        assert metric_or_none(router, reason) == 1


def metric_or_none(router, reason: str) -> float | None:
    """How many breaks for `reason` were continued, None before the first."""
    labels = f'model="{MODEL}",outcome="continued",reason="{reason}"'
    try:
        return metric(router, f"llmgw_router_stream_continuations_total{{{labels}}}")
    except AssertionError:
        return None
