"""The router over real HTTP: auth, errors in OpenAI's shape, proxying, streaming, balancing, retries."""

import asyncio
import json
import socket
import threading
import time

import aiohttp
import httpx
import openai
import pytest

from conftest import free_port, wait_until
from hub.contracts import Activation
from keys.models import ApiKey
from router.forwarding.exchange import DISCONNECT_WATCH_DELAY
from router.picking.ejection import EjectionPolicy
from router.tests.conftest import ALIAS, MODEL, make_table

pytestmark = pytest.mark.django_db(transaction=True)


def assert_openai_error(response, status: int, code: str, mentions: str = ""):
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert mentions in error["message"]
    return error


def chat(router, headers, model=MODEL, **extra):
    return httpx.post(
        f"{router.url}/v1/chat/completions",
        headers=headers,
        timeout=5,
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra},
    )


def run_concurrently(router, headers, count: int, model=MODEL):
    """Send `count` chat requests at once; return [(status, replica header)]."""

    async def one(session):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
        async with session.post(f"{router.url}/v1/chat/completions", json=body, headers=headers) as response:
            await response.read()
            return response.status, response.headers.get("x-llmgw-replica")

    async def many():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=8)) as session:
            return await asyncio.gather(*(one(session) for _ in range(count)))

    return asyncio.run(many())


# -- auth and bad input -------------------------------------------------------------------


def test_missing_key_is_401_in_openai_shape(start_router, hub, start_engine):
    hub.publish_endpoints(make_table([start_engine().url]))
    router = start_router()
    assert_openai_error(chat(router, {}), 401, "invalid_api_key", "Missing API key")


def test_wrong_key_is_401_and_only_one_database_lookup_is_made_for_it(start_router, hub, api_key):
    hub.publish_endpoints(make_table())
    router = start_router()
    for _ in range(3):
        assert_openai_error(chat(router, {"Authorization": "Bearer sk-wrong"}), 401, "invalid_api_key", "Invalid")
    assert router.state.keys.lookups == 1


def test_revoked_key_is_401(start_router, hub):
    key, plaintext = ApiKey.issue("revoked")
    key.active = False
    key.save()
    hub.publish_endpoints(make_table())
    router = start_router()
    assert_openai_error(chat(router, {"Authorization": f"Bearer {plaintext}"}), 401, "invalid_api_key")


def test_non_bearer_authorization_is_401(start_router, hub, api_key):
    router = start_router()
    assert_openai_error(chat(router, {"Authorization": f"Basic {api_key}"}), 401, "invalid_api_key", "Bearer")


def test_malformed_json_is_400_naming_the_problem(start_router, hub, auth):
    hub.publish_endpoints(make_table())
    router = start_router()
    response = httpx.post(f"{router.url}/v1/chat/completions", headers=auth, content=b"{not json")
    assert_openai_error(response, 400, "invalid_json", "not valid JSON")


def test_body_that_is_not_an_object_is_400(start_router, hub, auth):
    router = start_router()
    response = httpx.post(f"{router.url}/v1/chat/completions", headers=auth, json=["model"])
    assert_openai_error(response, 400, "invalid_body", "JSON object, not array")


def test_body_without_a_string_model_is_400_naming_model(start_router, hub, auth):
    router = start_router()
    response = httpx.post(f"{router.url}/v1/chat/completions", headers=auth, json={"model": 7})
    error = assert_openai_error(response, 400, "missing_model", '"model"')
    assert error["param"] == "model"


def test_unknown_model_is_404_naming_it(start_router, hub, auth, start_engine):
    hub.publish_endpoints(make_table([start_engine().url]))
    router = start_router()
    assert_openai_error(chat(router, auth, model="gpt-17"), 404, "model_not_found", "`gpt-17`")


def test_unknown_path_is_404_in_openai_shape(start_router):
    router = start_router()
    assert_openai_error(httpx.get(f"{router.url}/v2/anything"), 404, "not_found", "/v2/anything")


def test_wrong_method_on_a_proxy_path_is_405_in_openai_shape(start_router):
    router = start_router()
    response = httpx.get(f"{router.url}/v1/chat/completions")
    assert_openai_error(response, 405, "method_not_allowed")
    assert response.headers["allow"] == "POST"


# -- proxying --------------------------------------------------------------------------------


def test_openai_client_gets_a_chat_completion_through_the_router(start_router, hub, api_key, start_engine):
    engine = start_engine("a")
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router()
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=api_key, max_retries=0, timeout=5)
    completion = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert completion.choices[0].message.content == "hello from a"
    assert completion.usage.total_tokens == 4


def test_completions_and_embeddings_are_proxied(start_router, hub, auth, start_engine):
    engine = start_engine("a")
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router()
    completion = httpx.post(f"{router.url}/v1/completions", headers=auth, json={"model": MODEL, "prompt": "x"})
    embedding = httpx.post(f"{router.url}/v1/embeddings", headers=auth, json={"model": MODEL, "input": "x"})
    assert completion.json()["choices"][0]["text"] == "hi from a"
    assert embedding.json()["data"][0]["embedding"] == [0.1, 0.2]


def test_alias_is_resolved_and_the_engine_sees_the_public_name(start_router, hub, auth, start_engine):
    engine = start_engine()
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router()
    response = chat(router, auth, model=ALIAS, temperature=0.5)
    assert response.status_code == 200
    assert engine.requests[-1]["model"] == MODEL
    assert engine.requests[-1]["temperature"] == 0.5


def test_streaming_passes_each_chunk_through_before_the_engine_sends_the_next(start_router, hub, api_key, start_engine):
    engine = start_engine("s")
    engine.hold_first_chunk = True  # the engine sends the rest only after we saw the first chunk
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router()
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=api_key, max_retries=0, timeout=10)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices[0].delta.content == "Hello"
    engine.release.set()
    rest = [c.choices[0].delta.content for c in chunks]
    assert rest == [" from", " s"]
    assert engine.released_in_time is True


def test_models_lists_catalog_models_and_aliases(start_router, hub, auth):
    hub.publish_endpoints(make_table(models={MODEL: {"aliases": [ALIAS]}, "qwen": {"aliases": []}}))
    router = start_router()
    listing = httpx.get(f"{router.url}/v1/models", headers=auth).json()
    assert listing["object"] == "list"
    assert [(m["id"], m["root"]) for m in listing["data"]] == [(MODEL, MODEL), (ALIAS, MODEL), ("qwen", "qwen")]
    assert all(m["object"] == "model" for m in listing["data"])


def test_models_requires_a_key(start_router):
    router = start_router()
    assert_openai_error(httpx.get(f"{router.url}/v1/models"), 401, "invalid_api_key")


def test_health_counts_models_and_endpoints_and_metrics_count_requests(start_router, hub, auth, start_engine):
    hub.publish_endpoints(make_table([start_engine().url]))
    router = start_router()
    assert chat(router, auth).status_code == 200
    assert chat(router, auth, model="nope").status_code == 404
    health = httpx.get(f"{router.url}/health")
    assert health.status_code == 200
    assert health.json() | {"table": None} == {
        "status": "ok",
        "models": 1,
        "endpoints": 1,
        "in_flight": 0,
        "ejected": [],
        "table": None,
    }
    metrics = httpx.get(f"{router.url}/metrics").text
    assert f'llmgw_router_requests_total{{code="200",model="{MODEL}"}} 1.0' in metrics
    assert 'llmgw_router_requests_total{code="404",model="-"} 1.0' in metrics
    assert f'llmgw_router_upstream_latency_seconds_count{{model="{MODEL}"}} 1.0' in metrics
    assert "llmgw_router_in_flight_requests 0.0" in metrics


# -- balancing and retries ----------------------------------------------------------------------


def test_requests_go_to_the_higher_priority_replica(start_router, hub, auth, start_engine):
    low, high = start_engine("low"), start_engine("high")
    hub.publish_endpoints(make_table([{"url": low.url, "priority": 0}, {"url": high.url, "priority": 1}]))
    router = start_router()
    results = run_concurrently(router, auth, 4)
    assert [status for status, _ in results] == [200] * 4
    assert (len(low.requests), len(high.requests)) == (0, 4)


def test_concurrent_requests_spread_by_outstanding_requests(start_router, hub, auth, start_engine, settings):
    settings.LLMGW_PREFIX_AFFINITY_SLACK = 0  # the requests share a prompt: no affinity beyond equal loads
    a, b = start_engine("a", delay=0.3), start_engine("b", delay=0.3)
    hub.publish_endpoints(make_table([a.url, b.url]))
    router = start_router()
    results = run_concurrently(router, auth, 6)
    assert sorted(replica for _, replica in results) == ["1", "1", "1", "2", "2", "2"]
    assert a.max_active == b.max_active == 3


def test_request_is_retried_on_another_replica_when_one_refuses_connections(start_router, hub, auth, start_engine):
    live = start_engine("live")
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    hub.publish_endpoints(make_table([{"url": dead_url, "priority": 1}, {"url": live.url, "priority": 0}]))
    router = start_router()
    response = chat(router, auth)
    assert response.status_code == 200
    assert response.headers["x-llmgw-replica"] == "2"
    assert 'llmgw_router_retries_total{model="llama-3-8b"} 1.0' in httpx.get(f"{router.url}/metrics").text


def test_request_is_retried_on_another_replica_when_one_answers_503(start_router, hub, auth, start_engine):
    busy, live = start_engine("busy", status=503), start_engine("live")
    hub.publish_endpoints(make_table([{"url": busy.url, "priority": 1}, {"url": live.url, "priority": 0}]))
    router = start_router()
    response = chat(router, auth)
    assert response.json()["choices"][0]["message"]["content"] == "hello from live"
    assert len(busy.requests) == 1


def test_only_one_retry_and_then_the_engines_answer_is_passed_through(start_router, hub, auth, start_engine):
    engines = [start_engine(f"e{i}", status=503) for i in range(3)]
    hub.publish_endpoints(make_table([e.url for e in engines]))
    router = start_router()
    response = chat(router, auth)
    assert response.status_code == 503
    assert sum(len(e.requests) for e in engines) == 2


def test_unreachable_only_replica_holds_the_request_like_a_cold_start_then_503(start_router, hub, auth):
    """Nothing accepts the connection and no replica is left: wait for a replacement, bounded."""
    hub.publish_endpoints(make_table([f"http://127.0.0.1:{free_port()}"]))
    router = start_router(activation_timeout=0.5, retry_after=7)
    started = time.monotonic()
    response = chat(router, auth)
    assert time.monotonic() - started >= 0.5
    assert_openai_error(response, 503, "model_starting", MODEL)
    assert hub.drain_activations() == {Activation(model=MODEL)}
    assert router.state.ledger.in_flight() == 0
    # The only replica is never ejected: the next request tries it again.
    assert httpx.get(f"{router.url}/health").json()["ejected"] == []


def test_only_replica_dropping_connections_is_502_in_openai_shape(start_router, hub, auth):
    """A connection accepted then dropped may have reached the engine: no waiting, a 502."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()

    def drop_every_connection():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    threading.Thread(target=drop_every_connection, daemon=True).start()
    try:
        hub.publish_endpoints(make_table([f"http://127.0.0.1:{listener.getsockname()[1]}"]))
        router = start_router()
        assert_openai_error(chat(router, auth), 502, "upstream_unavailable", MODEL)
        assert router.state.ledger.in_flight() == 0
        assert_openai_error(chat(router, auth), 502, "upstream_unavailable", MODEL)
        assert httpx.get(f"{router.url}/health").json()["ejected"] == []
    finally:
        listener.close()


# -- outlier ejection ---------------------------------------------------------------------------


def metric(router, line_start: str) -> float:
    """The value of the first /metrics sample line starting with `line_start`."""
    for line in httpx.get(f"{router.url}/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no metric {line_start}")


def test_a_killed_engine_gets_one_request_which_is_retried_and_then_no_more(
    start_router, hub, auth, engine_process, start_engine
):
    doomed, live = engine_process(), start_engine("live")
    hub.publish_endpoints(make_table([{"url": doomed.url, "priority": 1}, {"url": live.url, "priority": 0}]))
    # A long cool-down, so no probe falls inside the test whatever the machine's speed.
    router = start_router(ejection=EjectionPolicy(first_cooldown=30, max_cooldown=30))
    assert [chat(router, auth).headers["x-llmgw-replica"] for _ in range(3)] == ["1"] * 3
    doomed.kill()

    responses = [chat(router, auth) for _ in range(20)]
    assert [r.status_code for r in responses] == [200] * 20
    assert {r.headers["x-llmgw-replica"] for r in responses} == {"2"}
    # Only the first request after the kill met the refused connection: it was retried, and ejected the replica.
    assert metric(router, f'llmgw_router_retries_total{{model="{MODEL}"}}') == 1
    assert metric(router, f'llmgw_router_ejections_total{{model="{MODEL}"}}') == 1
    assert metric(router, f'llmgw_router_ejected_replicas{{model="{MODEL}"}}') == 1
    assert httpx.get(f"{router.url}/health").json()["ejected"] == ["1"]
    assert len(live.requests) == 20


def test_a_request_to_a_model_whose_only_replica_died_waits_for_the_replacement(
    start_router, hub, auth, engine_process, start_engine
):
    doomed = engine_process()
    hub.publish_endpoints(make_table([doomed.url]))
    router = start_router(activation_timeout=10)
    assert chat(router, auth).headers["x-llmgw-replica"] == "1"
    doomed.kill()
    replacement = start_engine("replacement")

    def replace_when_asked():
        wait_until(lambda: hub.drain_activations() == {Activation(model=MODEL)}, timeout=5)
        hub.publish_endpoints(make_table([{"url": replacement.url, "replica_id": "2"}]))

    replacer = threading.Thread(target=replace_when_asked)
    replacer.start()
    response = chat(router, auth)
    replacer.join()
    assert (response.status_code, response.headers["x-llmgw-replica"]) == (200, "2")
    assert len(replacement.requests) == 1


def test_a_request_whose_every_replica_died_with_their_node_waits_for_a_replacement(
    start_router, hub, auth, engine_process, start_engine
):
    """Both replicas on one node: the retry fails too, and the request still waits instead of failing."""
    first, second = engine_process(), engine_process()
    hub.publish_endpoints(make_table([first.url, second.url]))
    router = start_router(activation_timeout=10)
    first.kill()
    second.kill()
    replacement = start_engine("replacement")

    def replace_when_asked():
        wait_until(lambda: hub.drain_activations() == {Activation(model=MODEL)}, timeout=5)
        hub.publish_endpoints(make_table([{"url": replacement.url, "replica_id": "1"}]))

    replacer = threading.Thread(target=replace_when_asked)
    replacer.start()
    response = chat(router, auth)
    replacer.join()
    assert (response.status_code, response.headers["x-llmgw-replica"]) == (200, "1")


def test_an_ejected_engine_that_comes_back_answers_its_probe_and_gets_requests_again(
    start_router, hub, auth, engine_process, start_engine
):
    doomed, live = engine_process(), start_engine("live")
    hub.publish_endpoints(make_table([{"url": doomed.url, "priority": 1}, {"url": live.url, "priority": 0}]))
    router = start_router(ejection=EjectionPolicy(first_cooldown=0.2))
    doomed.kill()
    assert chat(router, auth).headers["x-llmgw-replica"] == "2"
    assert httpx.get(f"{router.url}/health").json()["ejected"] == ["1"]
    engine_process(port=doomed.port)  # restarted where it was
    wait_until(lambda: chat(router, auth).headers["x-llmgw-replica"] == "1")
    assert httpx.get(f"{router.url}/health").json()["ejected"] == []
    assert all(chat(router, auth).headers["x-llmgw-replica"] == "1" for _ in range(3))


def test_an_engine_answering_503_three_times_in_a_row_is_ejected_and_clients_never_see_it(
    start_router, hub, auth, start_engine
):
    busy, live = start_engine("busy", status=503), start_engine("live")
    hub.publish_endpoints(make_table([{"url": busy.url, "priority": 1}, {"url": live.url, "priority": 0}]))
    router = start_router(ejection=EjectionPolicy(first_cooldown=30, max_cooldown=30))
    responses = [chat(router, auth) for _ in range(6)]
    assert [r.status_code for r in responses] == [200] * 6
    assert len(busy.requests) == 3
    assert metric(router, f'llmgw_router_retries_total{{model="{MODEL}"}}') == 3
    assert httpx.get(f"{router.url}/health").json()["ejected"] == ["1"]


@pytest.mark.parametrize("stay_seconds", [0.0, DISCONNECT_WATCH_DELAY + 0.3])
def test_a_client_leaving_before_or_after_the_disconnect_watch_starts_cuts_the_stream(
    start_router, hub, auth, start_engine, stay_seconds
):
    engine = start_engine("endless")
    engine.endless = True
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router()

    async def stay_then_leave():
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "messages": [], "stream": True}
            async with session.post(f"{router.url}/v1/chat/completions", json=body, headers=auth) as response:
                await response.content.readline()
                assert router.state.ledger.in_flight() == 1
                await asyncio.sleep(stay_seconds)
            # Leaving the block without reading to the end closes the connection.

    asyncio.run(stay_then_leave())
    assert engine.stream_cut.wait(3)
    wait_until(lambda: router.state.metrics.traffic.in_flight == 0)
    assert f'llmgw_router_requests_total{{code="499",model="{MODEL}"}} 1.0' in httpx.get(f"{router.url}/metrics").text


# -- cold start ------------------------------------------------------------------------------------


class CountingHub:
    """Wraps an InProcessHub to count the router's activation requests and usage reports."""

    def __init__(self, hub):
        self.hub = hub
        self.activations: list[str] = []
        self.reports: list = []  # one UsageReport per flush, whether or not anything was used
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.hub, name)

    async def request_activation(self, model_name, pools=()):
        with self._lock:
            self.activations.append(model_name)
        await self.hub.request_activation(model_name, pools)

    async def report_usage(self, report):
        with self._lock:
            self.reports.append(report)
        await self.hub.report_usage(report)

    @property
    def usage_flushes(self) -> list[dict]:
        """The stamps of the reports that carried any."""
        with self._lock:
            return [dict(report.stamps) for report in self.reports if report.stamps]

    @property
    def watch_renewals(self) -> int:
        with self._lock:
            return len(self.reports)


def test_many_waiters_share_one_activation_and_succeed_when_a_replica_is_published(
    start_router, hub, auth, start_engine
):
    counting = CountingHub(hub)
    hub.publish_endpoints(make_table())  # the model is known, nothing runs it
    router = start_router(counting, activation_timeout=5)
    engine = start_engine("cold")

    def publish_when_asked():
        wait_until(lambda: counting.activations)
        assert hub.drain_activations() == {Activation(model=MODEL)}
        hub.publish_endpoints(make_table([engine.url]))

    publisher = threading.Thread(target=publish_when_asked)
    publisher.start()
    results = run_concurrently(router, auth, 10, model=ALIAS)
    publisher.join()
    assert [status for status, _ in results] == [200] * 10
    assert counting.activations == [MODEL]
    assert len(engine.requests) == 10


def test_past_the_activation_bound_the_answer_is_503_with_retry_after(start_router, hub, auth):
    hub.publish_endpoints(make_table())
    router = start_router(activation_timeout=0.3, retry_after=7)
    response = chat(router, auth)
    error = assert_openai_error(response, 503, "model_starting", MODEL)
    assert error["type"] == "server_error"
    assert response.headers["retry-after"] == "7"
    assert hub.drain_activations() == {Activation(model=MODEL)}


def test_retry_after_carries_the_learned_start_time_less_the_wait(start_router, hub, auth):
    hub.publish_endpoints(make_table(models={MODEL: {"aliases": [], "start_seconds": 300.0}}))
    router = start_router(activation_timeout=0.3, retry_after=7)
    response = chat(router, auth)
    assert_openai_error(response, 503, "model_starting", MODEL)
    assert response.headers["retry-after"] == "300"  # ceil(300 - 0.3)


def test_a_model_the_control_plane_cannot_place_is_503_at_once_with_the_reason(start_router, hub, auth):
    reason = "needs 2 whole H100-80GB nodes on one fabric; free: 1 on ib-a, 1 on ib-b"
    hub.publish_endpoints(make_table(models={MODEL: {"aliases": [ALIAS], "unplaceable": reason}}))
    router = start_router(activation_timeout=30, retry_after=7)
    started = time.monotonic()
    response = chat(router, auth)
    assert time.monotonic() - started < 5  # not held until the activation deadline
    error = assert_openai_error(response, 503, "model_unplaceable", MODEL)
    assert reason in error["message"]
    assert response.headers["retry-after"] == "7"
    # Still asked (capacity may free up), in the background: the answer may come first.
    asked: set[Activation] = set()
    wait_until(lambda: asked.update(hub.drain_activations()) or asked == {Activation(model=MODEL)})


def stream_lines(router, headers, model=MODEL, timeout=10, on_line=None):
    """The raw lines of a streaming chat request, as (status, lines).

    `on_line(lines)`, if given, is called with the lines so far as each one arrives.
    """
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/chat/completions", headers=headers, json=body, timeout=timeout) as r:
        lines = []
        for line in r.iter_lines():
            if line:
                lines.append(line)
                if on_line is not None:
                    on_line(lines)
        return r.status_code, lines


def test_a_streaming_request_waiting_for_a_cold_start_gets_keepalives_then_the_answer(
    start_router, hub, auth, start_engine
):
    hub.publish_endpoints(make_table())
    router = start_router(activation_timeout=5, keepalive_seconds=0.1)
    engine = start_engine("cold")

    def publish_after_two_keepalives(lines):
        # Counted as the client receives them, so the test waits on events, not on the clock.
        if sum(line.startswith(":") for line in lines) == 2 and lines[-1].startswith(":"):
            wait_until(lambda: hub.drain_activations() == {Activation(model=MODEL)})
            hub.publish_endpoints(make_table([engine.url]))

    status, lines = stream_lines(router, auth, on_line=publish_after_two_keepalives)
    assert status == 200
    comments = [line for line in lines if line.startswith(":")]
    data = [line for line in lines if line.startswith("data:")]
    assert len(comments) >= 2 and lines.index(comments[-1]) < lines.index(data[0])
    assert data[-1] == "data: [DONE]" and len(engine.requests) == 1


def test_the_openai_client_streams_through_a_cold_start(start_router, hub, api_key, start_engine):
    hub.publish_endpoints(make_table())
    router = start_router(activation_timeout=5, keepalive_seconds=0.1)
    engine = start_engine("cold")
    threading.Timer(0.4, lambda: hub.publish_endpoints(make_table([engine.url]))).start()
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key=api_key, max_retries=0, timeout=10)
    chunks = list(
        client.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}], stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_streaming_request_past_the_activation_bound_ends_with_an_error_event(start_router, hub, auth):
    hub.publish_endpoints(make_table())
    router = start_router(activation_timeout=0.4, keepalive_seconds=0.1)
    status, lines = stream_lines(router, auth)
    assert status == 200  # committed when the wait began; the error travels in the stream
    assert lines[0].startswith(":")
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["code"] == "model_starting" and MODEL in error["message"]


def test_an_engine_error_after_a_cold_start_travels_in_the_stream(start_router, hub, auth, start_engine):
    hub.publish_endpoints(make_table())
    router = start_router(activation_timeout=5, keepalive_seconds=0.1)
    broken = start_engine("broken", status=500)
    threading.Timer(0.3, lambda: hub.publish_endpoints(make_table([broken.url]))).start()
    status, lines = stream_lines(router, auth)
    assert status == 200
    error = json.loads(lines[-1].removeprefix("data: "))["error"]
    assert error["code"] == "upstream_error" and "500" in error["message"]
    assert router.state.ledger.in_flight() == 0


def test_engine_silent_past_the_read_deadline_is_504_in_openai_shape(start_router, hub, auth, start_engine):
    slow = start_engine("slow", delay=1.0)
    hub.publish_endpoints(make_table([slow.url]))
    router = start_router(first_byte_timeout=0.2)
    assert_openai_error(chat(router, auth), 504, "upstream_timeout", "did not answer in time")
    wait_until(lambda: router.state.ledger.in_flight() == 0)
