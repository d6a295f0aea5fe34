"""A stream's time to first token and the gaps between its chunks, and how long held requests waited and why,
as the router's /metrics report them for requests over real HTTP."""

import threading
import time

import httpx
import pytest

from conftest import wait_until
from router.tests.conftest import MODEL, make_table
from router.tests.forwarding.test_proxy import chat, stream_lines
from router.tests.test_metrics import samples

pytestmark = pytest.mark.django_db(transaction=True)


def histogram(router, name: str, **labels) -> dict[str, float]:
    """`name`'s samples for `labels` (model MODEL unless given): {"count", "sum", and each bucket's `le`}."""
    labels.setdefault("model", MODEL)
    found = {}
    for (sample, sample_labels), value in samples(router.state.metrics).items():
        given = dict(sample_labels)
        le = given.pop("le", None)
        if given != labels:
            continue
        if sample == f"{name}_bucket":
            found[le] = value
        elif sample in (f"{name}_count", f"{name}_sum"):
            found[sample.rsplit("_", 1)[1]] = value
    return found


def test_a_streams_first_token_and_each_gap_between_its_chunks_are_observed(start_router, hub, auth, start_engine):
    engine = start_engine("paced", delay=0.2)
    engine.steps = threading.Semaphore(0)
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router()

    def next_chunk_after_a_pause(lines):
        # The engine sends its next chunk only once the client has this one: no two can travel as one.
        time.sleep(0.05)
        engine.steps.release()

    status, lines = stream_lines(router, auth, on_line=next_chunk_after_a_pause)
    assert status == 200 and lines[-1] == "data: [DONE]" and len(lines) == 4

    wait_until(lambda: histogram(router, "llmgw_router_inter_token_seconds").get("count") == 3)
    first = histogram(router, "llmgw_router_time_to_first_token_seconds")
    assert first["count"] == 1 and first["0.1"] == 0  # the engine took 0.2 s to begin
    assert 0.2 <= first["sum"] < 5
    gaps = histogram(router, "llmgw_router_inter_token_seconds")
    assert gaps["0.03"] == 0 and gaps["2.5"] == 3  # each gap is one pause of the client's, at least 0.05 s
    assert 0.15 <= gaps["sum"] < 5


def test_an_answer_that_is_not_streamed_has_no_first_token_time(start_router, hub, auth, start_engine):
    hub.publish_endpoints(make_table([start_engine().url]))
    router = start_router()
    assert chat(router, auth).status_code == 200
    assert histogram(router, "llmgw_router_upstream_latency_seconds")["count"] == 1
    assert histogram(router, "llmgw_router_time_to_first_token_seconds") == {}
    assert histogram(router, "llmgw_router_inter_token_seconds") == {}


def test_the_mock_engines_paced_tokens_are_timed_as_they_arrive(start_router, hub, auth, engine_process):
    engine = engine_process(token_delay_ms=40)
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router()
    status, lines = stream_lines(router, auth)
    assert status == 200 and lines[-1] == "data: [DONE]"

    wait_until(lambda: histogram(router, "llmgw_router_time_to_first_token_seconds").get("count") == 1)
    gaps = histogram(router, "llmgw_router_inter_token_seconds")
    # Its role chunk comes at once, then five tokens 40 ms apart: however the reads group them, the gaps add
    # up to the five waits.
    assert gaps["count"] >= 1 and 0.2 * 0.9 <= gaps["sum"] < 5


def held_request(router, auth, streaming):
    """Send a chat request in a thread (streamed if `streaming`); join() the thread for its status."""
    result = {}

    def send():
        if streaming:
            result["status"], result["lines"] = stream_lines(router, auth)
        else:
            result["status"] = chat(router, auth).status_code

    thread = threading.Thread(target=send)
    thread.start()
    return thread, result


@pytest.mark.parametrize(
    ("said", "reason"),
    [
        ((None,), "cold_start"),
        ((None, "wake"), "wake"),  # a table before the control plane knew said nothing; the next one says wake
        (("making_room",), "making_room"),
    ],
)
def test_a_held_request_is_timed_by_the_last_reason_the_table_gave(start_router, hub, auth, start_engine, said, reason):
    engine = start_engine("woken")
    router = start_router(activation_timeout=5)
    first, *later = said
    hub.publish_endpoints(make_table(models={MODEL: {"aliases": [], "holding": first}}))
    wait_until(lambda: router.state.routes.holding(MODEL) == first)
    thread, result = held_request(router, auth, streaming=False)
    wait_until(lambda: router.state.cold_start.waiting(MODEL) == 1)
    for holding in later:
        hub.publish_endpoints(make_table(models={MODEL: {"aliases": [], "holding": holding}}))
        # The waiter wakes on this table before the router can apply the next one (one loop, in order).
        wait_until(lambda holding=holding: router.state.routes.holding(MODEL) == holding)
    hub.publish_endpoints(make_table([engine.url]))
    thread.join(10)
    assert result["status"] == 200

    held = histogram(router, "llmgw_router_hold_seconds", reason=reason)
    # uvloop's loop.time() moves in whole milliseconds: a hold under one reads 0, and is still timed (count).
    assert held["count"] == 1 and 0 <= held["sum"] < 5
    others = {"cold_start", "wake", "making_room"} - {reason}
    assert all(histogram(router, "llmgw_router_hold_seconds", reason=other) == {} for other in others)


def test_a_held_streams_first_token_counts_its_hold_and_a_refused_hold_is_timed(start_router, hub, auth, start_engine):
    engine = start_engine("woken")
    hub.publish_endpoints(make_table(models={MODEL: {"aliases": [], "holding": "wake"}}))
    router = start_router(activation_timeout=5, keepalive_seconds=0.1)
    thread, result = held_request(router, auth, streaming=True)
    wait_until(lambda: router.state.cold_start.waiting(MODEL) == 1)
    time.sleep(0.3)  # a hold long enough to tell from the engine's own time
    hub.publish_endpoints(make_table([engine.url]))
    thread.join(10)
    assert result["status"] == 200 and result["lines"][-1] == "data: [DONE]"

    wait_until(lambda: histogram(router, "llmgw_router_time_to_first_token_seconds").get("count") == 1)
    held = histogram(router, "llmgw_router_hold_seconds", reason="wake")
    assert held["count"] == 1 and held["sum"] >= 0.3
    assert histogram(router, "llmgw_router_time_to_first_token_seconds")["sum"] >= held["sum"]


def test_a_hold_that_times_out_is_timed_and_one_refused_at_once_is_not(start_router, hub, auth):
    hub.publish_endpoints(
        make_table(
            models={
                MODEL: {"aliases": [], "holding": "making_room"},
                "stuck": {"aliases": [], "unplaceable": "no node has GPU class X"},
            }
        )
    )
    router = start_router(activation_timeout=0.3)
    assert chat(router, auth).status_code == 503
    assert chat(router, auth, model="stuck").status_code == 503

    held = histogram(router, "llmgw_router_hold_seconds", reason="making_room")
    # At least the 0.3 s timeout, to the float error of subtracting two event-loop times.
    assert held["count"] == 1 and 0.3 - 1e-6 <= held["sum"] < 5
    assert histogram(router, "llmgw_router_hold_seconds", model="stuck", reason="cold_start") == {}
    assert 'llmgw_router_hold_seconds_count{model="llama-3-8b",reason="making_room"} 1.0' in (
        httpx.get(f"{router.url}/metrics").text
    )
