"""Router-only mode: a fixed endpoint table given on the command line, with no control plane behind it.

`manage.py router --endpoint MODEL=URL ...` serves these models, each by the
one engine at its URL, in front of engines someone already runs. Nothing
starts or stops replicas: `StaticHub` publishes the table once, ignores
activation requests, and keeps usage reports in memory (no one reads them).
Key changes still arrive pushed when a Redis hub is configured (the admin or
`create_api_key` publish there); otherwise the key cache's TTL applies them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

import msgspec

from hub.contracts import EndpointRow, EndpointTable, KeyChangeSource, ModelEntry
from hub.memory import InProcessHub

# How `manage.py router` hands the table to its uvicorn workers (router.standalone reads it): not a setting.
TABLE_VARIABLE = "LLMGW_ROUTER_STATIC_TABLE"
# Said when a static model's engine does not answer: no one will start another.
NO_CONTROL_PLANE = "this router serves a fixed endpoint table (manage.py router --endpoint) and starts no replicas"


class EndpointSpecError(ValueError):
    """An --endpoint value that is not MODEL=URL, naming the value."""


def parse_endpoints(values: Iterable[str]) -> EndpointTable:
    """The endpoint table for `MODEL=URL` values: each model served by the one engine at its http(s) URL."""
    models: dict[str, ModelEntry] = {}
    endpoints: list[EndpointRow] = []
    for value in values:
        model, sep, url = value.partition("=")
        model, url = model.strip(), url.strip()
        if not sep or not model or not url:
            raise EndpointSpecError(f"--endpoint {value!r}: expected MODEL=URL, e.g. llama=http://10.0.0.5:8000")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EndpointSpecError(f"--endpoint {value!r}: {url!r} is not an http:// or https:// URL")
        if model in models:
            raise EndpointSpecError(f"--endpoint {value!r}: model {model!r} is given more than once")
        models[model] = ModelEntry(unplaceable=NO_CONTROL_PLANE)
        endpoints.append(EndpointRow(f"static-{len(endpoints) + 1}", model, url.rstrip("/")))
    if not models:
        raise EndpointSpecError("no --endpoint given")
    return EndpointTable(models, endpoints)


def encode_table(table: EndpointTable) -> str:
    """The table as the text `manage.py router` hands its worker processes."""
    return msgspec.json.encode(table).decode()


def decode_table_variable(text: str) -> EndpointTable:
    """The table `encode_table` wrote; EndpointSpecError naming the variable if it is not one."""
    try:
        return msgspec.json.decode(text, type=EndpointTable)
    except msgspec.DecodeError as exc:
        raise EndpointSpecError(f"{TABLE_VARIABLE} is not an endpoint table: {exc}") from None


class StaticHub(InProcessHub):
    """A hub holding one fixed table: no activations are asked of anyone; key changes from `key_changes` if given."""

    def __init__(self, table: EndpointTable, key_changes: KeyChangeSource | None = None) -> None:
        super().__init__()
        self.publish_endpoints(table)
        self._key_changes = key_changes

    async def request_activation(self, model_name: str, pools: Iterable[str] = ()) -> None:
        """Nothing to ask: there is no control plane. (The model's table entry says why it cannot start.)"""

    async def watch_key_changes(self) -> AsyncIterator[list[str]]:
        if self._key_changes is None:
            async for digests in super().watch_key_changes():
                yield digests
        else:
            async for digests in self._key_changes.watch_key_changes():
                yield digests
