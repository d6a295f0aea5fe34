"""LoRA adapters through the router: decoded from the table, named by name or alias, served by the replicas of
their base that hold them, held like a cold start while none does, listed with their parent, counted apart."""

import json
import logging
import threading
import time

import httpx
import msgspec
import pytest

from conftest import wait_until
from hub.contracts import Activation, AdapterEntry, EndpointRow, EndpointTable, ModelEntry
from hub.credentials import hash_secret
from keys.models import ApiKey
from router.endpoints.routes import ADAPTER_LOAD
from router.endpoints.table import decode_table
from router.tests.conftest import ALIAS, MODEL, in_flight_by_model, new_picker, pending_stamps
from router.tests.forwarding.test_proxy import CountingHub, assert_openai_error, chat, metric

pytestmark = pytest.mark.django_db(transaction=True)

ADAPTER = "sql-lora"
ADAPTER_ALIAS = "sql"
OTHER = "qwen"


def lora_table(urls=(), holders=(), *, adapter=None, models=None, fingerprint="") -> EndpointTable:
    """Replicas "1", "2", ... of MODEL at `urls`; ADAPTER (alias ADAPTER_ALIAS) on MODEL held by `holders`."""
    entry = {"base": MODEL, "aliases": [ADAPTER_ALIAS], "replicas": list(holders), **(adapter or {})}
    return EndpointTable(
        models=models or {MODEL: ModelEntry(aliases=[ALIAS]), OTHER: ModelEntry()},
        endpoints=[EndpointRow(replica_id=str(i + 1), model=MODEL, url=url) for i, url in enumerate(urls)],
        adapters={ADAPTER: AdapterEntry(**entry)},
        fingerprint=fingerprint,
    )


# -- the table -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ({"aliases": [], "replicas": ["1"]}, "missing required field `base`"),
        ({"base": MODEL, "replicas": "1"}, "`$.replicas`"),
        ({"base": MODEL, "loading": "yes"}, "`$.loading`"),
        ({"base": ""}, "`$.base`"),
        ("lora", "Expected `object`"),
    ],
)
def test_a_malformed_adapter_entry_is_left_out_and_logged_and_the_rest_is_served(caplog, entry, problem):
    table = {
        "models": {MODEL: {"aliases": []}},
        "endpoints": [{"replica_id": "1", "model": MODEL, "url": "http://a:1"}],
        "adapters": {"broken": entry, ADAPTER: {"base": MODEL, "aliases": [ADAPTER_ALIAS], "replicas": ["1"]}},
        "fingerprint": "f",
    }
    with caplog.at_level(logging.WARNING, logger="router.endpoints.table"):
        decoded = decode_table(json.dumps(table).encode())
    assert decoded.adapters == {ADAPTER: AdapterEntry(base=MODEL, aliases=[ADAPTER_ALIAS], replicas=["1"])}
    assert decoded.endpoints == [EndpointRow(replica_id="1", model=MODEL, url="http://a:1")]
    (record,) = caplog.records
    assert "'broken'" in record.message and problem in record.message


def test_names_and_aliases_resolve_to_the_adapter_and_only_listed_replicas_of_its_base_hold_it():
    picker = new_picker()
    table = lora_table(["http://a:1", "http://b:1"], ["2", "7", "9"])
    table = msgspec.structs.replace(
        table,
        endpoints=[
            *table.endpoints,
            EndpointRow(replica_id="9", model=OTHER, url="http://c:1"),
        ],  # listed, but a replica of another model
        adapters={**table.adapters, "orphan": AdapterEntry(base="gone", replicas=["1"])},
    )
    picker.routes.apply_table(table)
    assert picker.routes.resolve(ADAPTER) == picker.routes.resolve(ADAPTER_ALIAS) == ADAPTER
    assert picker.routes.resolve("orphan") is None  # its base is no model of the table: nothing could serve it
    assert picker.routes.base_of(ADAPTER) == MODEL and picker.routes.base_of(MODEL) is None
    assert [e.replica_id for e in picker.routes.endpoints(ADAPTER)] == ["2"]
    assert [e.replica_id for e in picker.routes.endpoints(MODEL)] == ["1", "2"]


def test_an_adapter_is_picked_only_among_its_holders_stamped_per_replica_and_counted_under_its_base():
    now = [1000.0]
    picker = new_picker(lambda: now[0])
    picker.routes.apply_table(lora_table(["http://a:1", "http://b:1", "http://c:1"], ["2", "3"]))
    picked = [picker.pick(ADAPTER) for _ in range(4)]
    assert sorted(e.replica_id for e in picked) == ["2", "2", "3", "3"]  # least outstanding among the holders
    assert pending_stamps(picker) == {"2": 1000.0, "2/sql-lora": 1000.0, "3": 1000.0, "3/sql-lora": 1000.0}
    assert in_flight_by_model(picker) == {MODEL: 4, ADAPTER: 4}  # the base's load, and the adapter's own
    model_request = picker.pick(MODEL)
    assert model_request is not None and model_request.replica_id == "1"  # the model's own pick counts the load
    assert in_flight_by_model(picker) == {MODEL: 5, ADAPTER: 4}
    for endpoint in picked[1:]:
        picker.release(endpoint, None, ADAPTER)
    picker.release(model_request, None, MODEL)
    picker.ledger.take_usage()
    now[0] = 2000.0
    # One adapter request still runs on its replica: both its replica and its adapter there stay in use.
    stamps, peaks = picker.ledger.take_usage()
    assert stamps == {picked[0].replica_id: 2000.0, f"{picked[0].replica_id}/{ADAPTER}": 2000.0}
    assert peaks == {MODEL: 1, ADAPTER: 1}
    picker.release(picked[0], None, ADAPTER)
    assert picker.ledger.take_usage() == ({}, {MODEL: 1, ADAPTER: 1})
    assert picker.ledger.take_usage() == ({}, {})


def test_an_adapter_on_a_running_base_is_held_for_its_load_not_refused_for_its_base():
    picker = new_picker()
    models = {MODEL: ModelEntry(unplaceable="no second GPU", start_seconds=90.0, holding="making_room")}
    picker.routes.apply_table(lora_table(["http://a:1"], [], models=models))
    # The base runs: loading the adapter on it is all it takes, whatever the base's scale-out notes say.
    assert picker.routes.unplaceable(ADAPTER) is None and picker.routes.start_seconds(ADAPTER) is None
    assert picker.routes.holding(ADAPTER) == ADAPTER_LOAD
    # No replica of the base: the base's notes answer for the adapter, until its load is under way.
    picker.routes.apply_table(lora_table([], [], models=models))
    assert picker.routes.unplaceable(ADAPTER) == "no second GPU" and picker.routes.start_seconds(ADAPTER) == 90.0
    assert picker.routes.holding(ADAPTER) == "making_room"
    picker.routes.apply_table(lora_table([], [], adapter={"loading": True}, models=models))
    assert picker.routes.holding(ADAPTER) == ADAPTER_LOAD


# -- over HTTP -------------------------------------------------------------------------------------


def token_totals(counting: CountingHub, digest: str) -> dict[str, list[int]]:
    """Model -> [requests, prompt, completion, spend] the router reported for `digest`, over every report so far."""
    totals: dict[str, list[int]] = {}
    for report in list(counting.reports):
        for model, count in report.tokens.get(digest, {}).items():
            total = totals.setdefault(model, [0, 0, 0, 0])
            for i, value in enumerate(msgspec.to_builtins(count)):
                total[i] += value
    return totals


def test_an_alias_is_rewritten_to_the_adapters_name_and_served_by_a_holder_stamped_and_counted(
    start_router, hub, auth, api_key, start_engine
):
    counting = CountingHub(hub)
    plain, holder = start_engine("plain"), start_engine("holder")
    hub.publish_endpoints(lora_table([plain.url, holder.url], ["2"]))
    router = start_router(counting, flush_seconds=0.1)
    for name in (ADAPTER_ALIAS, ADAPTER):
        response = chat(router, auth, model=name)
        assert response.status_code == 200, response.text
        assert response.headers["x-llmgw-replica"] == "2"
    assert [body["model"] for body in holder.requests] == [ADAPTER, ADAPTER] and plain.requests == []
    base = chat(router, auth)  # the base model itself, on any of its replicas
    assert base.status_code == 200
    # The fake engine answers 1 prompt and 3 completion tokens; the adapter's are its own, not its base's.
    digest = hash_secret(api_key)
    wait_until(lambda: token_totals(counting, digest) == {ADAPTER: [2, 2, 6, 0], MODEL: [1, 1, 3, 0]})
    stamps = {stamp for report in counting.reports for stamp in report.stamps}
    assert stamps == {base.headers["x-llmgw-replica"], "2", f"2/{ADAPTER}"}
    assert {model for report in counting.reports for model in report.in_flight} == {MODEL, ADAPTER}
    assert metric(router, f'llmgw_router_requests_total{{code="200",model="{ADAPTER}"}}') == 2
    assert metric(router, f'llmgw_router_requests_total{{code="200",model="{MODEL}"}}') == 1


def test_an_adapter_held_nowhere_is_held_asks_for_its_activation_and_is_served_once_a_table_lists_a_holder(
    start_router, hub, auth, start_engine
):
    counting = CountingHub(hub)
    engine = start_engine("base")
    hub.publish_endpoints(lora_table([engine.url], [], adapter={"loading": True}))
    router = start_router(counting, activation_timeout=5)

    def publish_when_asked():
        wait_until(lambda: counting.activations)
        assert router.state.cold_start.waiting(ADAPTER) == 1
        assert hub.drain_activations() == {Activation(model=ADAPTER)}
        hub.publish_endpoints(lora_table([engine.url], ["1"]))

    publisher = threading.Thread(target=publish_when_asked)
    publisher.start()
    response = chat(router, auth, model=ADAPTER_ALIAS)
    publisher.join()
    assert response.status_code == 200, response.text
    assert counting.activations == [ADAPTER]
    assert [body["model"] for body in engine.requests] == [ADAPTER]
    assert metric(router, f'llmgw_router_hold_seconds_count{{model="{ADAPTER}",reason="{ADAPTER_LOAD}"}}') == 1


def test_an_adapter_past_the_hold_is_503_with_retry_after_like_a_models_cold_start(start_router, hub, auth):
    hub.publish_endpoints(lora_table([], [], models={MODEL: ModelEntry(start_seconds=300.0)}))
    router = start_router(activation_timeout=0.3, retry_after=7)
    response = chat(router, auth, model=ADAPTER)
    error = assert_openai_error(response, 503, "model_starting", f"`{ADAPTER}` (an adapter of `{MODEL}`)")
    assert error["type"] == "server_error"
    assert response.headers["retry-after"] == "300"  # its idle base's learned start, less the wait
    assert hub.drain_activations() == {Activation(model=ADAPTER)}


@pytest.mark.parametrize(
    ("entry", "code"),
    [
        (ModelEntry(unplaceable="needs 2 H100-80GB, free: 1"), "model_unplaceable"),
        (ModelEntry(failed="engine exited with code 2"), "model_failed"),
    ],
)
def test_an_adapter_whose_idle_base_cannot_start_is_answered_at_once_as_for_the_base(
    start_router, hub, auth, entry, code
):
    hub.publish_endpoints(lora_table([], [], models={MODEL: entry}))
    router = start_router(activation_timeout=30, retry_after=7)
    started = time.monotonic()
    response = chat(router, auth, model=ADAPTER_ALIAS)
    assert time.monotonic() - started < 5  # not held until the activation deadline
    error = assert_openai_error(response, 503, code, f"`{ADAPTER}` (an adapter of `{MODEL}`)")
    assert (entry.unplaceable or entry.failed) in error["message"]
    assert response.headers["retry-after"] == "7"


def test_models_lists_the_adapters_a_key_may_use_with_their_parent(start_router, hub, auth):
    hub.publish_endpoints(lora_table())
    router = start_router()
    base_only = {"Authorization": f"Bearer {ApiKey.issue('base', allowed_models=[MODEL])[1]}"}
    by_alias = {"Authorization": f"Bearer {ApiKey.issue('lora', allowed_models=[ADAPTER_ALIAS])[1]}"}
    listing = httpx.get(f"{router.url}/v1/models", headers=auth).json()["data"]
    assert [(m["id"], m["root"], m.get("parent")) for m in listing] == [
        (MODEL, MODEL, None),
        (ALIAS, MODEL, None),
        (OTHER, OTHER, None),
        (ADAPTER, ADAPTER, MODEL),
        (ADAPTER_ALIAS, ADAPTER, MODEL),
    ]
    assert listing[3] == {"id": ADAPTER, "object": "model", "created": 0, "owned_by": "llmgw", "root": ADAPTER,
                          "parent": MODEL}  # fmt: skip
    # A key scoped to the base does not reach its adapters; one naming an adapter's alias reaches the adapter.
    assert [m["id"] for m in httpx.get(f"{router.url}/v1/models", headers=base_only).json()["data"]] == [MODEL, ALIAS]
    listed = httpx.get(f"{router.url}/v1/models", headers=by_alias).json()["data"]
    assert [(m["id"], m["parent"]) for m in listed] == [(ADAPTER, MODEL), (ADAPTER_ALIAS, MODEL)]
    retrieved = httpx.get(f"{router.url}/v1/models/{ADAPTER_ALIAS}", headers=by_alias).json()
    assert (retrieved["id"], retrieved["root"], retrieved["parent"]) == (ADAPTER_ALIAS, ADAPTER, MODEL)
    assert_openai_error(httpx.get(f"{router.url}/v1/models/{ADAPTER}", headers=base_only), 404, "model_not_found")
    assert_openai_error(chat(router, base_only, model=ADAPTER), 403, "model_not_allowed", ADAPTER)


def test_the_model_list_is_built_once_per_table_and_scope_and_follows_a_new_table(start_router, hub, auth):
    hub.publish_endpoints(lora_table())
    router = start_router()
    first = httpx.get(f"{router.url}/v1/models", headers=auth)
    assert httpx.get(f"{router.url}/v1/models", headers=auth).content == first.content
    assert len(router.app._model_lists) == 1  # one scope seen: one body kept

    extra = {"ft-2": AdapterEntry(base=MODEL)}
    hub.publish_endpoints(msgspec.structs.replace(lora_table(), adapters={**lora_table().adapters, **extra}))
    wait_until(lambda: router.app.state.routes.resolve("ft-2") == "ft-2")
    ids = [m["id"] for m in httpx.get(f"{router.url}/v1/models", headers=auth).json()["data"]]
    assert "ft-2" in ids and "ft-2" not in [m["id"] for m in first.json()["data"]]
