"""The per-request log at the router: with LLMGW_REQUEST_RECORD_DAYS set, each request a key made is recorded
(its key, model, status, tokens, spend at the table's prices, duration), reported with the usage flush and taken
from the hub, on both hubs; without it nothing is kept."""

import json

import httpx
import pytest

from conftest import wait_until
from hub import InProcessHub, RedisHub
from hub.credentials import hash_secret
from router.tests.accounting.test_budget_router import PRICE_IN, PRICE_OUT, PRICED
from router.tests.conftest import MODEL, make_table

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(params=["in-process", "redis"])
def records_hub(request):
    if request.param == "in-process":
        return InProcessHub()
    return RedisHub(request.getfixturevalue("redis_url"))


def chat(router, key: str, model: str = MODEL) -> httpx.Response:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return httpx.post(f"{router.url}/v1/chat/completions", content=body, headers=headers, timeout=10)


def test_each_request_is_recorded_and_reaches_the_hub(records_hub, start_router, start_engine, api_key):
    engine = start_engine()
    records_hub.publish_endpoints(make_table([engine.url], models=PRICED))
    router = start_router(records_hub, request_records=True, flush_seconds=0.1)
    assert chat(router, api_key).status_code == 200
    engine.status = 503
    assert chat(router, api_key).status_code == 503
    taken = []
    wait_until(lambda: taken.extend(records_hub.take_records()) or len(taken) == 2)
    ok, failed = taken
    assert (ok.key, ok.model, ok.status, ok.prompt, ok.completion) == (hash_secret(api_key), MODEL, 200, 1, 3)
    assert ok.spend == PRICE_IN + 3 * PRICE_OUT and 0 <= ok.milliseconds < 10_000
    assert (failed.status, failed.prompt, failed.completion, failed.spend) == (503, 0, 0, 0)
    assert ok.at <= failed.at


def test_without_the_setting_nothing_is_kept(start_router, hub, start_engine, api_key):
    hub.publish_endpoints(make_table([start_engine().url], models=PRICED))
    router = start_router()
    assert chat(router, api_key).status_code == 200
    assert router.state.ledger.records is None and hub.take_records() == []
