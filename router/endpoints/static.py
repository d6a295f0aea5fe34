"""Router-only mode: a fixed endpoint table given on the command line or in a file, with no control plane.

`manage.py router --endpoint MODEL=URL ... [--alias ALIAS=MODEL ...] [--endpoints FILE]`
serves these models in front of engines someone already runs. A model given
several URLs has several endpoint rows, balanced, ejected and retried as a
fleet's replicas are. An endpoint may carry its engine's own API key
(`EndpointRow.api_key`, from the file form only: router.endpoints.file), sent
to that engine alone. Nothing starts or stops replicas: the hubs here hold the
table fixed and ignore activation requests. Usage reports, rate-limit counts
and key changes go to Redis when REDIS_URL is set (`SharedStaticHub`, so every
worker and router process shares one limit), else stay in this process
(`StaticHub`); either way the app's `TokenStore` (router.accounting.store) takes the
token counts from the hub and stores them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import msgspec

from hub.contracts import EndpointRow, EndpointTable, ModelEntry
from hub.fingerprint import fingerprinted
from hub.memory import InProcessHub
from hub.redis_hub import RedisHub
from router.accounting.store import STORE_SECONDS, TokenStore
from router.app import RouterApp, create_app
from router.config import RouterConfig

# How `manage.py router` hands the table to its uvicorn workers (router.standalone reads it): not a setting.
TABLE_VARIABLE = "LLMGW_ROUTER_STATIC_TABLE"
# Said when a static model's engines do not answer: no one will start another.
NO_CONTROL_PLANE = "this router serves a fixed endpoint table (manage.py router --endpoint) and starts no replicas"


# How a model's broken streams may be continued (router.forwarding.continuation): not at all, from the text sent so
# far, or by token ids (every engine of the model is a vLLM, which gives and takes them).
STREAM_WAYS = ("off", "text", "token_ids")


class EndpointSpecError(ValueError):
    """An endpoint, alias or endpoints file that cannot be served, naming the value or the place in the file."""


@dataclass(frozen=True)
class EndpointSpec:
    """One engine URL of a model, with what the table says of it; `where` names it in errors."""

    model: str
    url: str
    where: str
    api_key: str | None = field(default=None, repr=False)
    priority: int = 0
    weight: int = 1
    pool: str = "default"


@dataclass
class StaticTableSpec:
    """What router-only mode was given: endpoints in order, aliases with where each was given."""

    endpoints: list[EndpointSpec] = field(default_factory=list)
    aliases: list[tuple[str, str, str]] = field(default_factory=list)  # (alias, model, where)
    # Model -> how its broken streams are continued (STREAM_WAYS), where the file says; else from their text.
    streams: dict[str, str] = field(default_factory=dict)

    def extend(self, other: StaticTableSpec) -> None:
        self.endpoints += other.endpoints
        self.aliases += other.aliases
        self.streams.update(other.streams)


def http_url_problem(url: str) -> str | None:
    """Why `url` is not an engine's base URL (http or https with a host), or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"{url!r} is not an http:// or https:// URL"
    return None


def parse_endpoint_options(endpoints: Iterable[str], aliases: Iterable[str] = ()) -> StaticTableSpec:
    """The spec of `--endpoint MODEL=URL` and `--alias ALIAS=MODEL` values (repeatable; a model may have
    several URLs)."""
    spec = StaticTableSpec()
    for value in endpoints:
        where = f"--endpoint {value!r}"
        model, sep, url = (part.strip() for part in value.partition("="))
        if not sep or not model or not url:
            raise EndpointSpecError(f"{where}: expected MODEL=URL, e.g. llama=http://10.0.0.5:8000")
        if problem := http_url_problem(url):
            raise EndpointSpecError(f"{where}: {problem}")
        spec.endpoints.append(EndpointSpec(model, url.rstrip("/"), where))
    for value in aliases:
        where = f"--alias {value!r}"
        alias, sep, model = (part.strip() for part in value.partition("="))
        if not sep or not alias or not model:
            raise EndpointSpecError(f"{where}: expected ALIAS=MODEL, e.g. llama3=llama-3.1-8b-instruct")
        spec.aliases.append((alias, model, where))
    return spec


def build_table(spec: StaticTableSpec) -> EndpointTable:
    """The endpoint table of `spec`: rows `static-1`, `static-2`… in the order given; EndpointSpecError when
    nothing is given, an endpoint repeats, or an alias clashes with a model or another alias or names no model."""
    if not spec.endpoints:
        raise EndpointSpecError("no endpoint given (--endpoint MODEL=URL or --endpoints FILE)")
    rows: list[EndpointRow] = []
    seen: dict[tuple[str, str], str] = {}
    for each in spec.endpoints:
        if (each.model, each.url) in seen:
            earlier = seen[each.model, each.url]
            raise EndpointSpecError(f"{each.where}: {each.url} is already an endpoint of {each.model!r} ({earlier})")
        seen[each.model, each.url] = each.where
        key = msgspec.UNSET if each.api_key is None else each.api_key
        rows.append(
            EndpointRow(
                replica_id=f"static-{len(rows) + 1}",
                model=each.model,
                url=each.url,
                priority=each.priority,
                weight=each.weight,
                pool=each.pool,
                api_key=key,
            )
        )
    aliases: dict[str, list[str]] = {row.model: [] for row in rows}
    given: dict[str, str] = {}
    for alias, model, where in spec.aliases:
        if alias in aliases:
            raise EndpointSpecError(f"{where}: alias {alias!r} is the name of a model")
        if alias in given:
            raise EndpointSpecError(f"{where}: alias {alias!r} is already given ({given[alias]})")
        if model not in aliases:
            raise EndpointSpecError(f"{where}: model {model!r} has no endpoint")
        given[alias] = where
        aliases[model].append(alias)
    models = {}
    for name, names in aliases.items():
        way = spec.streams.get(name, "text")
        models[name] = ModelEntry(
            aliases=names, unplaceable=NO_CONTROL_PLANE, continue_streams=way != "off", token_ids=way == "token_ids"
        )
    return EndpointTable(models=models, endpoints=rows)


def describe_table(table: EndpointTable) -> str:
    """The table for the start-up banner: each model, its aliases and URLs; an engine's key shown only as set."""
    lines = []
    for model, entry in table.models.items():
        aliases = f" (alias {', '.join(entry.aliases)})" if entry.aliases else ""
        urls = [
            row.url + ("" if row.api_key is msgspec.UNSET else " [api key ***]")
            for row in table.endpoints
            if row.model == model
        ]
        lines.append(f"{model}{aliases} → {', '.join(urls)}")
    return "; ".join(lines)


def encode_table(table: EndpointTable) -> str:
    """The table as the text `manage.py router` hands its worker processes (in their environment, never argv)."""
    return msgspec.json.encode(table).decode()


def decode_table_variable(text: str) -> EndpointTable:
    """The table `encode_table` wrote; EndpointSpecError naming the variable if it is not one."""
    try:
        return msgspec.json.decode(text, type=EndpointTable)
    except msgspec.DecodeError as exc:
        raise EndpointSpecError(f"{TABLE_VARIABLE} is not an endpoint table: {exc}") from None


class _FixedTable:
    """The table side of a router-only hub: one table, never changed, and no one to ask for activations."""

    _fixed: bytes

    def _fix(self, table: EndpointTable) -> None:
        self._fixed = fingerprinted(table)[1]

    async def read_endpoints(self) -> bytes | None:
        return self._fixed

    async def watch_endpoints(self) -> AsyncIterator[bytes]:
        """The table never changes: nothing is ever yielded."""
        await asyncio.Event().wait()
        yield self._fixed  # never reached

    async def request_activation(self, model_name: str, pools: Iterable[str] = ()) -> None:
        """Nothing to ask: there is no control plane. (The model's table entry says why it cannot start.)"""


class StaticHub(_FixedTable, InProcessHub):
    """Router-only mode without Redis: a fixed table; usage, rate-limit counts and token counts in this process."""

    def __init__(self, table: EndpointTable) -> None:
        super().__init__()
        self._fix(table)


class SharedStaticHub(_FixedTable, RedisHub):
    """Router-only mode with Redis: a fixed table; usage reports, rate-limit counts, token counts and key
    changes in Redis, shared by every worker and router process using it."""

    def __init__(self, table: EndpointTable, url: str) -> None:
        super().__init__(url)
        self._fix(table)


def create_router_only_app(
    table: EndpointTable,
    redis_url: str = "",
    config: RouterConfig | None = None,
    *,
    store_seconds: float = STORE_SECONDS,
) -> RouterApp:
    """A router app serving `table` with no control plane: its hub shared in Redis when `redis_url` is given,
    else in this process; either way storing its token usage itself (router.accounting.store)."""
    hub = SharedStaticHub(table, redis_url) if redis_url else StaticHub(table)
    return create_app(hub, config, token_store=TokenStore(hub, store_seconds))
