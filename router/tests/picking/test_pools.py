"""Keys bound to pools: refused at once for a model with no profile in them, else held for a replica in them
(the activation names the pools), and served by that replica only."""

import threading
import time

import pytest

from conftest import wait_until
from hub.contracts import Activation, AdapterEntry, EndpointRow, EndpointTable, ModelEntry
from keys.models import ApiKey
from router.tests.conftest import MODEL, make_table, new_picker
from router.tests.conftest import chat_with_key as chat
from router.tests.forwarding.test_proxy import assert_openai_error

pytestmark = pytest.mark.django_db(transaction=True)


def pool_key(*pools: str) -> str:
    """A key bound to `pools`, committed so the router's thread reads it."""
    return ApiKey.issue("pool-bound", allowed_pools=list(pools))[1]


def test_a_key_bound_to_pools_none_of_the_models_profiles_are_in_is_403_at_once_and_asks_for_nothing(start_router, hub):
    hub.publish_endpoints(make_table(models={MODEL: {"pools": ["gold"]}}))
    router = start_router(activation_timeout=5)
    started = time.monotonic()
    response = chat(router, pool_key("silver", "bronze"))
    assert time.monotonic() - started < 1  # not held for the 5 s a start may take
    error = assert_openai_error(response, 403, "model_not_in_pools", f"`{MODEL}`")
    assert "bronze, silver" in error["message"] and error["param"] == "model"
    assert hub.drain_activations() == set()


def test_a_key_bound_to_a_pool_of_the_model_is_held_asks_in_its_pools_and_is_served_there(
    start_router, hub, start_engine
):
    other, mine = start_engine("other"), start_engine("mine")
    # A ready replica in another pool does not serve the key: its request waits for one in its pools.
    models = {MODEL: {"pools": ["default", "gold"]}}
    hub.publish_endpoints(make_table([other.url], models=models))
    router = start_router(activation_timeout=5)
    asked: set[Activation] = set()

    def publish_when_asked():
        wait_until(lambda: asked.update(hub.drain_activations()) or asked)
        rows = [other.url, {"url": mine.url, "pool": "gold"}]
        hub.publish_endpoints(make_table(rows, models=models))

    publisher = threading.Thread(target=publish_when_asked)
    publisher.start()
    response = chat(router, pool_key("silver", "gold"))
    publisher.join()
    assert response.status_code == 200, response.text
    assert asked == {Activation(model=MODEL, pools=("gold", "silver"))}
    assert len(mine.requests) == 1 and other.requests == []


def test_a_note_on_a_start_in_some_pools_answers_keys_of_those_pools_at_once_and_holds_the_others(start_router, hub):
    note = {"pools": ["default", "gold"], "unplaceable": "in pool gold: no room", "unplaceable_pools": ["gold"]}
    hub.publish_endpoints(make_table(models={MODEL: note}))
    router = start_router(activation_timeout=0.3)
    error = assert_openai_error(chat(router, pool_key("gold")), 503, "model_unplaceable", "in pool gold: no room")
    assert error["type"] == "server_error"
    # A key of another pool, or of none, waits for its own start.
    assert_openai_error(chat(router, pool_key("default")), 503, "model_starting", MODEL)
    assert_openai_error(chat(router, ApiKey.issue("unbound")[1]), 503, "model_starting", MODEL)


def test_a_table_naming_no_pools_for_a_model_refuses_no_key_for_its_pools(start_router, hub):
    hub.publish_endpoints(make_table())
    router = start_router(activation_timeout=0.3)
    assert_openai_error(chat(router, pool_key("gold")), 503, "model_starting", MODEL)
    assert hub.drain_activations() == {Activation(model=MODEL, pools=("gold",))}


def test_an_adapter_is_in_its_bases_pools():
    picker = new_picker()
    picker.routes.apply_table(
        EndpointTable(
            models={"base": ModelEntry(pools=["gold"]), "bare": ModelEntry()},
            endpoints=[EndpointRow(replica_id="1", model="base", url="http://a:1", pool="gold")],
            adapters={"tuned": AdapterEntry(base="base")},
        )
    )
    gold, silver = frozenset({"gold"}), frozenset({"silver", "x"})
    assert picker.routes.serves_pools("base", gold) and picker.routes.serves_pools("tuned", gold)
    assert not picker.routes.serves_pools("base", silver) and not picker.routes.serves_pools("tuned", silver)
    assert picker.routes.serves_pools("base", frozenset())  # an unbound key
    assert picker.routes.serves_pools("bare", silver)  # pools not published: nothing refused
