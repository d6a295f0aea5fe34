"""Router-only mode's table: several URLs per model, aliases, engines' own API keys, the file form, all checked
with errors that name the value or the place in the file."""

import hashlib
import re

import msgspec
import pytest
import yaml

from hub.contracts import EndpointRow, EndpointTable, ModelEntry
from hub.fingerprint import fingerprint
from router.endpoints.file import load_endpoints_file, parse_endpoints_document
from router.endpoints.static import (
    NO_CONTROL_PLANE,
    TABLE_VARIABLE,
    EndpointSpecError,
    build_table,
    decode_table_variable,
    describe_table,
    encode_table,
    parse_endpoint_options,
)
from router.endpoints.table import decode_table, endpoint_of


def table_of(endpoints=(), aliases=()) -> EndpointTable:
    return build_table(parse_endpoint_options(endpoints, aliases))


@pytest.mark.parametrize(
    ("endpoints", "aliases", "problem"),
    [
        (["llama"], [], "--endpoint 'llama': expected MODEL=URL"),
        (["=http://127.0.0.1:1"], [], "--endpoint '=http://127.0.0.1:1': expected MODEL=URL"),
        (["llama=ftp://host/"], [], "--endpoint 'llama=ftp://host/': 'ftp://host/' is not an http:// or https:// URL"),
        (["llama=127.0.0.1:8000"], [], "--endpoint 'llama=127.0.0.1:8000': '127.0.0.1:8000' is not an http"),
        (["a=http://h:1", "a=http://h:1/"], [], "--endpoint 'a=http://h:1/': http://h:1 is already an endpoint of 'a'"),
        ([], [], "no endpoint given"),
        (["a=http://h:1"], ["a3"], "--alias 'a3': expected ALIAS=MODEL"),
        (["a=http://h:1", "b=http://h:2"], ["b=a"], "--alias 'b=a': alias 'b' is the name of a model"),
        (["a=http://h:1", "b=http://h:2"], ["x=a", "x=b"], "--alias 'x=b': alias 'x' is already given (--alias 'x=a')"),
        (["a=http://h:1"], ["x=nope"], "--alias 'x=nope': model 'nope' has no endpoint"),
    ],
)
def test_bad_endpoints_and_aliases_are_refused_naming_the_value(endpoints, aliases, problem):
    with pytest.raises(EndpointSpecError, match="^" + re.escape(problem)):
        table_of(endpoints, aliases)


def test_a_model_given_several_urls_gets_one_row_each_and_its_aliases():
    table = table_of(
        ["llama=http://10.0.0.5:8000/", "qwen=https://10.0.0.6", "llama=http://10.0.0.7:8000"], ["l3=llama"]
    )
    assert table.endpoints == [
        EndpointRow(replica_id="static-1", model="llama", url="http://10.0.0.5:8000"),
        EndpointRow(replica_id="static-2", model="qwen", url="https://10.0.0.6"),
        EndpointRow(replica_id="static-3", model="llama", url="http://10.0.0.7:8000"),
    ]
    assert table.models == {
        "llama": ModelEntry(aliases=["l3"], unplaceable=NO_CONTROL_PLANE),
        "qwen": ModelEntry(unplaceable=NO_CONTROL_PLANE),
    }
    assert decode_table_variable(encode_table(table)) == table


@pytest.mark.parametrize("text", ["", "[]", '{"endpoints": [{"model": "llama"}]}'])
def test_a_worker_refuses_a_handed_table_it_cannot_read_naming_the_variable(text):
    with pytest.raises(EndpointSpecError, match=f"^{TABLE_VARIABLE} is not an endpoint table"):
        decode_table_variable(text)


def test_a_row_without_a_key_is_the_same_bytes_as_before_keys_existed():
    row = EndpointRow(replica_id="7", model="m", url="http://h:1", priority=2, weight=3, pool="big")
    assert msgspec.json.encode(row) == (
        b'{"replica_id":"7","model":"m","url":"http://h:1","priority":2,"weight":3,"pool":"big"}'
    )
    table = EndpointTable(models={"m": ModelEntry()}, endpoints=[row])
    # The digest a fleet's table had before: its bytes are unchanged, so is its fingerprint.
    before = b'{"endpoints":[{"model":"m","pool":"big","priority":2,"replica_id":"7","url":"http://h:1","weight":3}],'
    assert fingerprint(table) == hashlib.sha256(before + b'"models":{"m":{}}}').hexdigest()
    keyed = msgspec.structs.replace(row, api_key="sk-engine")
    assert b'"api_key":"sk-engine"' in msgspec.json.encode(keyed)
    assert "sk-engine" not in repr(keyed) and "api_key=<set>" in repr(keyed)


def test_the_router_builds_an_endpoints_header_once_from_its_key_and_none_without():
    keyed = endpoint_of(EndpointRow(replica_id="1", model="m", url="http://h:1", api_key="sk-engine"))
    assert keyed.authorization == {"Authorization": "Bearer sk-engine"}
    assert "sk-engine" not in repr(keyed)
    assert endpoint_of(EndpointRow(replica_id="2", model="m", url="http://h:2")).authorization is None
    # A key that could not travel in a header is refused with its row, not sent.
    bad = (
        b'{"models": {"m": {}}, "endpoints": [{"replica_id": "1", "model": "m", "url": "http://h", "api_key": "a b"}]}'
    )
    assert decode_table(bad).endpoints == []


FILE = """
models:
  llama-3.1-8b-instruct:
    aliases: [llama3, llama]
    endpoints:
      - url: http://10.0.0.5:8000/
        api_key_env: LLAMA_A_KEY
      - url: https://10.0.0.6:8000
        api_key: sk-engine-b
        weight: 2
        priority: 1
        pool: big
      - http://10.0.0.7:8000
  qwen:
    endpoints: [http://10.0.0.8:8000]
"""


def test_the_file_form_gives_urls_keys_weights_and_aliases(tmp_path):
    path = tmp_path / "endpoints.yaml"
    path.write_text(FILE)
    spec = load_endpoints_file(path, {"LLAMA_A_KEY": "sk-engine-a"})
    spec.extend(parse_endpoint_options(["qwen=http://10.0.0.9:8000"], ["q=qwen"]))  # the options add to it
    table = build_table(spec)
    model = "llama-3.1-8b-instruct"
    assert table.endpoints == [
        EndpointRow(replica_id="static-1", model=model, url="http://10.0.0.5:8000", api_key="sk-engine-a"),
        EndpointRow(
            replica_id="static-2",
            model=model,
            url="https://10.0.0.6:8000",
            priority=1,
            weight=2,
            pool="big",
            api_key="sk-engine-b",
        ),
        EndpointRow(replica_id="static-3", model=model, url="http://10.0.0.7:8000"),
        EndpointRow(replica_id="static-4", model="qwen", url="http://10.0.0.8:8000"),
        EndpointRow(replica_id="static-5", model="qwen", url="http://10.0.0.9:8000"),
    ]
    assert table.models[model].aliases == ["llama3", "llama"] and table.models["qwen"].aliases == ["q"]
    banner = describe_table(table)
    assert "sk-engine" not in banner
    assert (
        f"{model} (alias llama3, llama) → http://10.0.0.5:8000 [api key ***], https://10.0.0.6:8000 [api key" in banner
    )


def test_the_file_says_per_model_how_broken_streams_are_continued():
    document = "models: {a: {endpoints: ['http://a']}, b: {endpoints: ['http://b'], streams: token_ids}, "
    document += "c: {endpoints: ['http://c'], streams: 'off'}}"
    models = build_table(parse_endpoints_document(yaml.safe_load(document), {})).models
    ways = {name: (entry.continue_streams, entry.token_ids) for name, entry in models.items()}
    assert ways == {"a": (True, False), "b": (True, True), "c": (False, False)}


@pytest.mark.parametrize(
    ("document", "problem"),
    [
        ("", "the file: expected a mapping, not NoneType"),
        ("model: {}", "the file: unknown key model (allowed: models)"),
        ("models: {}", "models: no model given"),
        ("models: {m: {endpoints: []}}", "models.m.endpoints: expected a list of at least one endpoint"),
        (
            "models: {m: {endpoints: [x], extra: 1}}",
            "models.m: unknown key extra (allowed: aliases, endpoints, streams)",
        ),
        (
            "models: {m: {endpoints: ['http://a'], streams: tokens}}",
            "models.m.streams: 'tokens' is not one of off, text, token_ids",
        ),
        (
            "models: {m: {endpoints: [{url: 'http://a'}, {url: 'ftp://b'}]}}",
            "models.m.endpoints[1].url: 'ftp://b' is not",
        ),
        ("models: {m: {endpoints: [{api_key: k}]}}", "models.m.endpoints[0].url: missing"),
        ("models: {m: {endpoints: [{url: 'http://a', wieght: 2}]}}", "models.m.endpoints[0]: unknown key wieght"),
        ("models: {m: {endpoints: [{url: 'http://a', weight: 0}]}}", "models.m.endpoints[0].weight: 0 is not a whole"),
        ("models: {m: {endpoints: [{url: 'http://a', priority: x}]}}", "models.m.endpoints[0].priority: 'x' is not"),
        ("models: {m: {endpoints: [{url: 'http://a', pool: ''}]}}", "models.m.endpoints[0].pool: '' is not a pool"),
        (
            "models: {m: {endpoints: [{url: 'http://a', api_key: k, api_key_env: K}]}}",
            "models.m.endpoints[0]: give api_key or api_key_env, not both",
        ),
        (
            "models: {m: {endpoints: [{url: 'http://a', api_key_env: NOT_SET_HERE}]}}",
            "models.m.endpoints[0].api_key_env: the environment variable NOT_SET_HERE is not set",
        ),
        (
            "models: {m: {endpoints: [{url: 'http://a', api_key: 'two words'}]}}",
            "models.m.endpoints[0].api_key: the key holds spaces",
        ),
        ("models: {m: {endpoints: ['http://a'], aliases: m2}}", "models.m.aliases: expected a list of names"),
        (
            "models: {m: {endpoints: ['http://a'], aliases: [n]}, n: {endpoints: ['http://b']}}",
            "models.m.aliases[0]: alias 'n' is the name of a model",
        ),
        (
            "models: {m: {endpoints: ['http://a'], aliases: [x]}, n: {endpoints: ['http://b'], aliases: [x]}}",
            "models.n.aliases[0]: alias 'x' is already given (models.m.aliases[0])",
        ),
        ("models: {1: {endpoints: ['http://a']}}", "models: 1 is not a model name"),
    ],
)
def test_a_bad_file_is_refused_naming_the_place_in_it(document, problem):
    with pytest.raises(EndpointSpecError, match="^" + re.escape(problem)):
        build_table(parse_endpoints_document(yaml.safe_load(document), {}))


def test_a_file_that_cannot_be_read_or_parsed_is_named(tmp_path):
    with pytest.raises(EndpointSpecError, match=r"^--endpoints .*missing.yaml: cannot read it"):
        load_endpoints_file(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: [")
    with pytest.raises(EndpointSpecError, match=r"^--endpoints .*broken.yaml: not YAML"):
        load_endpoints_file(broken)
    secret = tmp_path / "secret.yaml"
    secret.write_text("models: {m: {endpoints: [{url: 'http://a', api_key: 'sk-secret x'}]}}")
    with pytest.raises(EndpointSpecError) as refused:
        load_endpoints_file(secret)
    assert "sk-secret" not in str(refused.value)
