"""A model whose only replica failed is answered at once: 503 `model_failed` in OpenAI's shape, with
the engine's own last line, not held until the activation deadline; a replica starting again
(the reason gone from the table) makes requests wait for it once more."""

import threading
import time

import httpx
import pytest

from conftest import wait_until
from router.tests.conftest import ALIAS, MODEL, make_table
from router.tests.forwarding.test_proxy import assert_openai_error, chat

REASON = "engine exited with code 2: mock_engine: error: unrecognized arguments: --no-such-flag"


def test_a_model_whose_replica_failed_is_503_at_once_with_the_engines_words(start_router, hub, auth):
    hub.publish_endpoints(make_table(models={MODEL: {"aliases": [ALIAS], "failed": REASON}}))
    router = start_router(activation_timeout=30, retry_after=7)
    started = time.monotonic()
    response = chat(router, auth, model=ALIAS)
    assert time.monotonic() - started < 5  # not held until the activation deadline
    error = assert_openai_error(response, 503, "model_failed", MODEL)
    assert error["type"] == "server_error"
    assert f"its last one failed ({REASON})" in error["message"]
    assert response.headers["retry-after"] == "7"


def test_a_waiting_request_is_failed_as_soon_as_the_table_says_so(start_router, hub, auth):
    hub.publish_endpoints(make_table())
    router = start_router(activation_timeout=30, retry_after=7)
    answers = []
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    url = f"{router.url}/v1/chat/completions"
    waiter = threading.Thread(target=lambda: answers.append(httpx.post(url, headers=auth, json=body, timeout=20)))
    started = time.monotonic()
    waiter.start()
    wait_until(lambda: router.state.cold_start.waiting(MODEL) == 1)  # it waits for a replica to start
    assert not answers
    hub.publish_endpoints(make_table(models={MODEL: {"aliases": [ALIAS], "failed": REASON}}))
    waiter.join(10)
    assert time.monotonic() - started < 6
    assert_openai_error(answers[0], 503, "model_failed", "unrecognized arguments: --no-such-flag")


@pytest.mark.parametrize("bad", [None, "", 3, ["x"]])
def test_a_malformed_failed_reason_is_ignored(start_router, hub, auth, bad):
    hub.publish_endpoints(make_table(models={MODEL: {"aliases": [ALIAS], "failed": bad}}))
    router = start_router(activation_timeout=0.3, retry_after=7)
    assert_openai_error(chat(router, auth), 503, "model_starting", MODEL)
