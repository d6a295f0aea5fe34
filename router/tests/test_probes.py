"""The router's liveness and readiness probes (router.app): /healthz answers while the process runs, draining
included; /readyz once an endpoint table is installed and until the router drains."""

import httpx
import pytest

from conftest import wait_until
from router.tests.conftest import make_table


@pytest.mark.django_db(transaction=True)
def test_a_router_is_ready_once_it_has_a_table_and_stops_being_ready_when_draining(start_router, hub):
    router = start_router()
    assert httpx.get(f"{router.url}/healthz").json() == {"status": "alive"}
    not_yet = httpx.get(f"{router.url}/readyz")
    assert (not_yet.status_code, not_yet.json()["reason"]) == (503, "no endpoint table received yet")
    hub.publish_endpoints(make_table(["http://127.0.0.1:1"]))
    wait_until(lambda: httpx.get(f"{router.url}/readyz").status_code == 200)
    router.state.begin_drain()
    draining = httpx.get(f"{router.url}/readyz")
    assert (draining.status_code, draining.json()["reason"]) == (503, "the router is shutting down")
    assert httpx.get(f"{router.url}/healthz").status_code == 200  # alive while it drains
    assert httpx.get(f"{router.url}/v1/models").status_code == 503  # what it refuses meanwhile
