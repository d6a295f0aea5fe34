"""Each model's recent window, cut from the router's cumulative figures at every flush and sent in its usage report."""

import httpx
import pytest

from conftest import wait_until
from hub.windows import FIRST_TOKEN_BUCKETS, QUEUE_WAIT_BUCKETS
from router.accounting.windows import RecentWindows
from router.forwarding.admission import Admission
from router.metrics import Traffic
from router.tests.conftest import MODEL, make_table, new_picker


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def keeper(window_seconds=60.0):
    traffic, clock = Traffic(), Clock()
    admission = Admission(new_picker(), max_waiting=10, max_wait_seconds=5, keepalive_seconds=1)
    return traffic, admission, clock, RecentWindows(traffic, admission, window_seconds, clock)


def bucket(bounds, value):
    return next(i for i, bound in enumerate(bounds) if value <= bound)


def test_a_window_holds_what_was_counted_within_its_length_and_forgets_what_is_older():
    traffic, admission, clock, windows = keeper(window_seconds=60)
    assert windows.take() == {}  # nothing counted yet: nothing reported
    traffic.first_token.observe("llama", 0.3)
    admission.waits.observe(("llama", "batch"), 2.0)
    admission.served_tokens["llama", "red"] = 500
    admission.weights["red"] = 3
    clock.now += 30
    first = windows.take()["llama"]
    assert first.ttft[bucket(FIRST_TOKEN_BUCKETS, 0.3)] == 1 and sum(first.ttft) == 1
    assert first.waits == {
        "batch": [1 if i == bucket(QUEUE_WAIT_BUCKETS, 2.0) else 0 for i in range(len(QUEUE_WAIT_BUCKETS) + 1)]
    }
    assert first.served == {"red": 500} and first.weights == {"red": 3} and first.itl == []

    traffic.first_token.observe("llama", 5.0)
    admission.served_tokens["llama", "red"] = 800
    clock.now += 40  # the first counts are now 70 s old, past the 60 s window
    windows.take()
    clock.now += 30
    later = windows.take()["llama"]
    assert sum(later.ttft) == 1 and later.ttft[bucket(FIRST_TOKEN_BUCKETS, 5.0)] == 1
    assert later.served == {"red": 300} and later.waits == {}


def test_requests_waiting_now_are_reported_with_their_class():
    _, admission, _, windows = keeper()
    admission.waiting = lambda: {("llama", "interactive"): 2, ("llama", "batch"): 0}
    assert windows.take()["llama"].waiting == {"interactive": 2}


@pytest.mark.django_db(transaction=True)
def test_a_routers_usage_report_carries_its_streams_first_tokens(start_router, hub, auth, start_engine):
    engine = start_engine()
    hub.publish_endpoints(make_table([engine.url]))
    router = start_router(flush_seconds=0.1)
    for _ in range(3):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json=body, headers=auth, timeout=10) as answer:
            assert answer.status_code == 200
            answer.read()

    def first_tokens():
        windows = [mark.windows[MODEL] for mark in hub.collect_usage().routers if MODEL in mark.windows]
        return any(sum(window.ttft) == 3 for window in windows)

    wait_until(first_tokens, timeout=10.0)
