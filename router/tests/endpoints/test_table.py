"""The endpoint table as the router decodes it: a malformed row is left out and logged, the rest still served."""

import json
import logging

import msgspec
import pytest

from hub.contracts import EndpointRow, EndpointTable, ModelEntry
from router.endpoints.table import TableError, decode_table
from router.tests.conftest import ALIAS, MODEL, make_table, new_picker, table_rows
from router.tests.forwarding.test_proxy import chat

GOOD = {"replica_id": "1", "model": MODEL, "url": "http://a:1", "priority": 0, "weight": 1, "pool": "default"}


def encoded(table: dict) -> bytes:
    return json.dumps(table).encode()


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({"replica_id": "9", "model": MODEL}, "missing required field `url`"),
        ({"replica_id": "9", "model": MODEL, "url": "x"}, "`$.url`"),
        ({"replica_id": "9", "model": MODEL, "url": "http://c:1", "weight": 0}, "`$.weight`"),
        ({"replica_id": 9, "model": MODEL, "url": "http://c:1"}, "`$.replica_id`"),
        ({"replica_id": "9", "model": MODEL, "url": "http://c:1", "priority": "high"}, "`$.priority`"),
        ("http://c:1", "Expected `object`"),
        (None, "Expected `object`"),
    ],
)
def test_a_malformed_endpoint_row_is_skipped_and_logged_with_what_is_wrong(caplog, row, problem):
    with caplog.at_level(logging.WARNING, logger="router.endpoints.table"):
        table = decode_table(
            encoded({"models": {MODEL: {"aliases": []}}, "endpoints": [row, GOOD], "fingerprint": "f"})
        )
    assert table.endpoints == [EndpointRow(replica_id="1", model=MODEL, url="http://a:1")]
    assert table.fingerprint == "f"
    (record,) = caplog.records
    assert "skipping an endpoint" in record.message and problem in record.message


@pytest.mark.parametrize(
    ("entry", "kept"),
    [
        ({"aliases": [ALIAS], "failed": 3}, ModelEntry(aliases=[ALIAS])),
        ({"aliases": [ALIAS], "unplaceable": ""}, ModelEntry(aliases=[ALIAS])),
        ({"aliases": [ALIAS], "start_seconds": -1}, ModelEntry(aliases=[ALIAS])),
        ({"aliases": "not a list", "failed": "engine exited"}, ModelEntry()),
        (["not", "an", "object"], ModelEntry()),
    ],
)
def test_a_malformed_model_entry_keeps_its_name_and_sound_aliases_and_loses_its_notes(caplog, entry, kept):
    with caplog.at_level(logging.WARNING, logger="router.endpoints.table"):
        table = decode_table(encoded({"models": {MODEL: entry, "qwen": {"aliases": ["q"]}}, "endpoints": [GOOD]}))
    assert table.models == {MODEL: kept, "qwen": ModelEntry(aliases=["q"])}
    assert len(table.endpoints) == 1
    (record,) = caplog.records
    assert f"model {MODEL!r}" in record.message and "ignoring its notes" in record.message


def test_fields_the_router_does_not_know_are_ignored():
    """A newer control plane may add fields: an older router still serves what it knows of the table."""
    rows = table_rows([{"url": "http://a:1", "gpu": "H100"}], models={MODEL: {"aliases": [], "adapters": ["x"]}})
    table = decode_table(encoded({**rows, "cluster": "eu"}))
    assert table == EndpointTable(
        models={MODEL: ModelEntry()}, endpoints=[EndpointRow(replica_id="1", model=MODEL, url="http://a:1")]
    )


@pytest.mark.parametrize("data", [b'["endpoints"]', b"not json", b'{"endpoints": 3}', b'{"models": []}'])
def test_what_is_not_a_table_at_all_is_refused_by_name(data):
    with pytest.raises(TableError, match="endpoint table is not an object of the published shape"):
        decode_table(data)


def test_a_decoded_table_is_what_the_control_plane_built():
    built = make_table(["http://a:1/", {"url": "https://b:2", "priority": 3, "weight": 2, "pool": "batch"}])
    built = msgspec.structs.replace(
        built, models={MODEL: ModelEntry(aliases=[ALIAS], unplaceable="no room", failed=None, start_seconds=12.5)}
    )
    assert decode_table(msgspec.json.encode(built)) == built


def test_the_balancer_serves_the_sound_rows_of_a_table_with_a_bad_one():
    picker = new_picker()
    picker.routes.apply_table(decode_table(encoded({**table_rows(["http://a:1"]), "endpoints": [GOOD, {"url": 1}]})))
    assert [e.replica_id for e in picker.routes.endpoints(MODEL)] == ["1"]
    assert picker.routes.resolve(ALIAS) == MODEL


def test_a_router_serves_a_published_table_whose_other_row_is_bad(start_router, hub, auth, start_engine):
    engine = start_engine()
    # Built, not decoded: nothing stops a buggy control plane from publishing this row.
    bad = EndpointRow(replica_id="2", model=MODEL, url="ftp://nowhere", weight=0)
    hub.publish_endpoints(
        msgspec.structs.replace(make_table([engine.url]), endpoints=[bad, *make_table([engine.url]).endpoints])
    )
    router = start_router()
    assert chat(router, auth).status_code == 200
    assert [e.replica_id for e in router.state.routes.endpoints(MODEL)] == ["1"]


def test_a_router_keeps_its_table_when_handed_something_that_is_not_one(start_router, hub, auth, start_engine, caplog):
    hub.publish_endpoints(make_table([start_engine().url]))
    router = start_router()
    with caplog.at_level(logging.ERROR, logger="router.state"):
        assert router.state.apply_table(b"[]") is False
    assert "ignoring a malformed endpoint table" in caplog.text
    assert chat(router, auth).status_code == 200


@pytest.mark.parametrize("moving", [{"1": "soon"}, ["1"], {"1": -5.0}, {"": 1.0}])
def test_malformed_moves_are_all_ignored_and_logged_and_the_rest_is_served(caplog, moving):
    with caplog.at_level(logging.WARNING, logger="router.endpoints.table"):
        table = decode_table(encoded({"models": {MODEL: {}}, "endpoints": [GOOD], "moving": moving}))
    assert table.moving == {} and len(table.endpoints) == 1
    (record,) = caplog.records
    assert "ignoring the endpoint table's moves" in record.message


def test_moves_are_decoded_as_published():
    table = decode_table(encoded({"models": {MODEL: {}}, "endpoints": [GOOD], "moving": {"7": 1765000000.25}}))
    assert table.moving == {"7": 1765000000.25}
