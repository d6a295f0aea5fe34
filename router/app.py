"""The router: a hand-written ASGI app that proxies OpenAI requests to ready engine replicas.

No Django request cycle runs here; Django is used only for settings and, on an
API-key cache miss, the ORM. This module routes each request (the OpenAI proxy
paths, /v1/models, /health, the /healthz and /readyz probes, /metrics), checks its key and model, and hands it
to the proxy; `router.state` holds what the app keeps in memory and runs its
lifecycle.

`create_app()` builds an app; `app.state` (a RouterState) is what the embedded
`up` command and tests inspect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from hub import get_hub
from hub.contracts import RequestRecord, RouterHub
from router.accounting.budgets import cost_of
from router.accounting.store import TokenStore
from router.config import RouterConfig
from router.errors import RouterError, method_not_allowed, shutting_down
from router.forwarding.admission import class_of
from router.forwarding.asgi_io import JSON_CONTENT_TYPE, Receive, Scope, Send, read_body, send_bytes, send_json
from router.forwarding.body import decode_object, echo, requested_model
from router.forwarding.exchange import Forwarding
from router.forwarding.paths import PROXY_PATHS
from router.key_cache import NOT_CACHED, ApiKeyCache, KeyInfo, KeyStoreUnreachable
from router.metrics import UNKNOWN_MODEL, metrics_token_ok
from router.picking.affinity import Prefix, prefix_affinity
from router.state import RouterState

log = logging.getLogger(__name__)

MODEL_PATH_PREFIX = "/v1/models/"
# Liveness and readiness, outside auth, the access log and the metrics (router.app's _probe).
PROBE_PATHS = frozenset({"/healthz", "/readyz"})
# The most /v1/models bodies kept at once (one per key scope seen since the table last changed).
MODEL_LISTS_KEPT = 256
# nginx's convention for "the client closed the request"; only ever a metric label.
CLIENT_CLOSED = 499


class RouterApp:
    """The ASGI callable. Routes: the OpenAI proxy paths, /v1/models, /v1/models/{id}, /health, /healthz, /readyz,
    /metrics."""

    def __init__(self, state: RouterState):
        self.state = state
        # Keys expire at an instant of the wall clock (UTC), the same on every router.
        self._wall_clock = state.clock
        # The parts every request touches, bound once rather than looked up through `state` per request.
        self._routes = state.routes
        self._limits = state.ledger.limits
        self._keys = state.keys
        self._budgets = state.budgets
        self._admission = state.proxy.admission
        self._records = state.ledger.records  # None unless routers keep a per-request log
        self._metrics = state.metrics
        self._proxy = state.proxy
        self._max_body_bytes = state.config.max_body_bytes
        self._metrics_token = state.config.metrics_token
        self._in_flight = state.in_flight
        # /v1/models bodies by key scope, for the table installed `_listed_for` (the route table's generation).
        self._model_lists: dict[tuple[frozenset[str], frozenset[str]], bytes] = {}
        self._listed_for = -1

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # HTTP is routed here rather than in a method of its own: a coroutine less on every request.
        if scope["type"] != "http":
            await self._not_http(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        try:
            # Probes are answered while draining too: that is when a balancer needs to know.
            if self.state.draining and path != "/metrics" and path not in PROBE_PATHS:
                raise shutting_down()
            if path in PROXY_PATHS:
                if method != "POST":
                    raise method_not_allowed(method, path, b"POST")
                await self._proxy_request(scope, receive, send, path)
            elif path == "/v1/models":
                if method != "GET":
                    raise method_not_allowed(method, path, b"GET")
                key = await self._authorize(scope)
                await send_bytes(send, 200, self._model_list_body(key), JSON_CONTENT_TYPE)
            elif path.startswith(MODEL_PATH_PREFIX):
                if method != "GET":
                    raise method_not_allowed(method, path, b"GET")
                key = await self._authorize(scope)
                await send_json(send, 200, self._model(key, path[len(MODEL_PATH_PREFIX) :]))
            elif path in PROBE_PATHS:
                await self._probe(path, send)
            elif path == "/health":
                await send_json(send, 200, self._health())
            elif path == "/metrics":
                if not metrics_token_ok(scope["headers"], self._metrics_token):
                    raise RouterError(
                        401,
                        "/metrics needs 'Authorization: Bearer <token>' (LLMGW_METRICS_TOKEN).",
                        "invalid_metrics_token",
                        headers=[(b"www-authenticate", b"Bearer")],
                    )
                await send_bytes(send, 200, self._metrics.render(), self._metrics.content_type.encode())
            else:
                raise RouterError(404, f"Unknown path: {method} {path}", "not_found")
        except RouterError as exc:
            await send_bytes(send, exc.status, exc.body(), JSON_CONTENT_TYPE, exc.headers)

    async def _not_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "websocket":
            await receive()
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.state.start()
                except Exception as exc:
                    log.exception("router startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.state.stop()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _model_list_body(self, key: KeyInfo) -> bytes:
        """/v1/models as sent, built once per table and key scope: with thousands of adapters, building and
        encoding the list is most of the answer's cost, and it changes only with the table."""
        generation = self._routes.generation
        if generation != self._listed_for:
            self._model_lists.clear()
            self._listed_for = generation
        scopes = (key.allowed_models, key.team_models)
        body = self._model_lists.get(scopes)
        if body is None:
            if len(self._model_lists) >= MODEL_LISTS_KEPT:
                self._model_lists.clear()  # many scopes: start over rather than grow without bound
            body = self._model_lists[scopes] = json.dumps(self._model_list(key)).encode()
        return body

    def _model_list(self, key: KeyInfo) -> dict[str, Any]:
        """Every model the key may use, under its name and each alias; then its LoRA adapters, likewise."""
        resolve = self._routes.resolve
        data: list[dict[str, Any]] = []
        for public, aliases in sorted(self._routes.catalog().items()):
            if key.allows(public, resolve):
                data.extend(_model_object(name, public) for name in (public, *aliases))
        for public, adapter in sorted(self._routes.adapters().items()):
            if key.allows(public, resolve):
                data.extend(_model_object(name, public, adapter.base) for name in (public, *adapter.aliases))
        return {"object": "list", "data": data}

    def _model(self, key: KeyInfo, name: str) -> dict[str, Any]:
        """One model or adapter by name or alias (the SDK's `models.retrieve`); one outside the key's scope is
        not shown."""
        public = self._routes.resolve(name)
        if public is None or not key.allows(public, self._routes.resolve):
            raise RouterError(404, f"The model `{name}` does not exist.", "model_not_found", param="model")
        return _model_object(name, public, self._routes.base_of(public))

    async def _probe(self, path: str, send: Send) -> None:
        """/healthz: the process answers. /readyz: it can route: an endpoint table installed and not draining.
        Neither reads anything but memory, so a kubelet or a balancer may poll them every second."""
        if path == "/healthz":
            await send_bytes(send, 200, b'{"status":"alive"}', JSON_CONTENT_TYPE)
            return
        state = self.state
        if state.draining:
            problem = "the router is shutting down"
        elif not self._routes.generation:
            problem = "no endpoint table received yet"
        else:
            await send_bytes(send, 200, b'{"status":"ready"}', JSON_CONTENT_TYPE)
            return
        await send_json(send, 503, {"status": "not_ready", "reason": problem})

    def _health(self) -> dict[str, Any]:
        state, routes = self.state, self._routes
        return {
            "status": "ok",
            "models": len(routes.catalog()),
            "endpoints": len(routes.by_replica),
            "in_flight": state.ledger.in_flight(),
            "ejected": sorted(e.replica_id for e in state.picker.ejected()),
            "table": routes.fingerprint,
        }

    def _cached_key(self, scope: Scope) -> KeyInfo | None:
        """The request's key if the key cache answers for it (None: the store must be asked), or a 401
        RouterError. No coroutine: the hot path of every request."""
        info = self._keys.cached(bearer_token(scope))
        return None if info is NOT_CACHED else usable_key(info, self._wall_clock)

    async def _authorize(self, scope: Scope) -> KeyInfo:
        """The request's key, or a RouterError: 401 when missing, unknown, revoked or expired."""
        return self._cached_key(scope) or await self._stored_key(scope)

    async def _stored_key(self, scope: Scope) -> KeyInfo:
        """The request's key as the store has it (the cache had no answer): a 401 RouterError when it is
        unknown, revoked or expired, a 503 when it cannot be verified."""
        token = bearer_token(scope)
        try:
            info = await self._keys.check(token)
        except KeyStoreUnreachable:
            raise RouterError(
                503,
                "Cannot verify the API key: the key store is unreachable. Retry shortly.",
                "key_store_unreachable",
                type_="server_error",
                headers=[(b"retry-after", b"1")],
            ) from None
        except Exception:
            log.exception("could not verify an API key")
            raise RouterError(
                503,
                "The API key could not be verified right now; try again.",
                "key_check_unavailable",
                type_="server_error",
            ) from None
        return usable_key(info, self._wall_clock)

    async def _proxy_request(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        received = time.perf_counter()  # a stream's time to first token counts from here
        traffic = self._metrics.traffic
        model = UNKNOWN_MODEL
        try:
            key = self._cached_key(scope) or await self._stored_key(scope)
            body = await read_body(receive, self._max_body_bytes)
            if body is None:
                traffic.answered(model, CLIENT_CLOSED)
                return
            model, body, streaming, affinity, payload = self._parse(body)
            self._admit(key, model)
            if model in self._routes.by_priority:  # its engines order their own queue by it: the key's class
                payload["priority"] = class_of(scope, key)
                body = json.dumps(payload).encode()
            hold = None
            if key.budgets:  # keys without budgets pay this test and nothing more
                asked, prices = (model, body, payload), self._routes.prices.get(model)
                hold = await self._budgets.reserve(key.budgets, key.digest, asked, prices)
        except RouterError as exc:
            traffic.answered(model, exc.status)
            raise

        # Tokens are counted per key digest (what ApiKey.key_hash stores), see router.accounting.usage_reader. The client may
        # go away while we wait for a replica or stream: the sweep of requests in flight then cancels this
        # task, so the upstream request stops with it (router.forwarding.inflight).
        exchange = self._in_flight.begin(key.digest, receive)
        if hold is not None:
            exchange.hold = hold
        traffic.in_flight += 1
        pools = key.allowed_pools or None
        request = Forwarding(
            scope, send, path, model, body, exchange, streaming, affinity, pools, received=received, key=key
        )
        try:
            await self._proxy.forward(request)
        except asyncio.CancelledError:
            if not exchange.client_gone():
                raise
            # The client left. A disconnect after the whole answer is just its end.
            if not exchange.complete:
                exchange.status = CLIENT_CLOSED
        except RouterError as exc:
            exchange.status = exc.status
            raise
        except BaseException:
            exchange.status = exchange.status or 500
            raise
        finally:
            self._ended(request, received)

    def _ended(self, request: Forwarding, received: float) -> None:
        """The request is over, in any way: count it, settle its budgets if its relay did not, log it if asked."""
        exchange, traffic = request.exchange, self._metrics.traffic
        self._in_flight.end(exchange)
        traffic.in_flight -= 1
        status = exchange.status or CLIENT_CLOSED
        traffic.answered(request.model, status)
        if exchange.hold is not None and not exchange.settled:
            self._budgets.settle(exchange.hold, exchange.usage, answered(request, status))
        if request.admitted is not None or request.waited is not None:
            self._admission.ended(request)
        records = self._records
        if records is not None and exchange.key is not None:
            records.append(request_record(request, self._routes.prices.get(request.model), status, received))

    def _admit(self, key: KeyInfo, model: str) -> None:
        """Nothing if `key` may send a request for `model` now; else a RouterError: 403 for a model outside its
        scope or with no profile in its pools (no replica could ever serve it, so it is not held), 429 past its
        rate limits. Set and dict lookups only."""
        routes, allowed, team = self._routes, key.allowed_models, key.team_models
        if (allowed and model not in allowed or team and model not in team) and not key.allows(model, routes.resolve):
            raise model_not_allowed(key, model, by_team=not key.team_allows(model, routes.resolve))
        if key.allowed_pools and not routes.serves_pools(model, key.allowed_pools):
            raise model_not_in_pools(key, model)
        if key.rpm is not None or key.tpm is not None:
            self._limits.admit(key.digest, key.name, key.rpm, key.tpm)

    def _parse(self, body: bytes) -> tuple[str, bytes, bool, Prefix | None, dict[str, Any]]:
        """(public model name, body for the engine, whether it streams, prompt prefix: router.picking.affinity, the
        request decoded), or a RouterError naming the problem. The public name is a LoRA adapter's when the request
        names one (or its alias)."""
        payload = decode_object(body)
        requested = requested_model(payload)
        public = self._routes.resolve(requested)
        if public is None:
            raise RouterError(404, f"The model `{echo(requested)}` does not exist.", "model_not_found", param="model")
        if public != requested:
            # Engines serve under the public name only.
            payload["model"] = public
            body = json.dumps(payload).encode()
        # A prefix only matters where there is a choice of replicas (router.picking.affinity): not hashed otherwise.
        affinity = prefix_affinity(payload) if self._routes.has_choice(public) else None
        return public, body, payload.get("stream") is True, affinity, payload


def answered(request: Forwarding, status: int) -> bool:
    """Whether an engine was asked and an answer given (a 2xx began, the client may have left it midway): then one
    whose usage never came is charged what it reserved. An error (the engine's, or a stream that broke on our
    side) costs nothing, and so does a wait for a replica the client gave up (keep-alives are no answer)."""
    return bool(request.tried) and request.headers_sent and (200 <= status < 300 or status == CLIENT_CLOSED)


def request_record(
    request: Forwarding, prices: tuple[int, int, int] | None, status: int, received: float
) -> RequestRecord:
    """The per-request log's record of a request that ended (`received`: its arrival, on perf_counter)."""
    exchange = request.exchange
    usage = exchange.usage
    if exchange.hold is not None:
        spend = cost_of(exchange.hold, usage, answered(request, status))
    elif usage is not None and prices is not None:
        spend = usage[0] * prices[0] + usage[1] * prices[1]
    else:
        spend = 0
    elapsed = time.perf_counter() - received
    assert exchange.key is not None  # recorded only for a key's request
    return RequestRecord(
        at=time.time() - elapsed,
        key=exchange.key,
        model=request.model,
        status=status,
        prompt=usage[0] if usage is not None else 0,
        completion=usage[1] if usage is not None else 0,
        spend=spend,
        milliseconds=int(elapsed * 1000),
    )


def bearer_token(scope: Scope) -> str:
    """The API key a request carries, or a 401 RouterError when it carries none."""
    header: bytes | None = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            header = value
            break
    if header is None:
        raise RouterError(401, "Missing API key: send it as 'Authorization: Bearer <key>'.", "invalid_api_key")
    scheme, _, key = header.decode("latin-1").partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise RouterError(401, "The Authorization header must be 'Bearer <key>'.", "invalid_api_key")
    return key


def usable_key(info: KeyInfo | None, clock: Callable[[], float]) -> KeyInfo:
    """`info` if it is a key that may be used now (`clock`: the wall clock, read only for a key that
    expires), or a 401 RouterError: unknown, revoked or expired."""
    if info is None:
        raise RouterError(401, "Invalid API key (unknown or revoked).", "invalid_api_key")
    expires_at = info.expires_at
    if expires_at is not None and clock() >= expires_at:
        when = datetime.fromtimestamp(expires_at, UTC).isoformat(timespec="seconds")
        raise RouterError(401, f"The API key “{info.name}” expired at {when}.", "expired_api_key")
    return info


def _model_object(name: str, public: str, parent: str | None = None) -> dict[str, Any]:
    """OpenAI's model object; a LoRA adapter's also names its base model as `parent`, as vLLM lists them."""
    found = {"id": name, "object": "model", "created": 0, "owned_by": "llmgw", "root": public}
    if parent is not None:
        found["parent"] = parent
    return found


def model_not_allowed(key: KeyInfo, model: str, by_team: bool = False) -> RouterError:
    """403: the key's scope, or its team's (`by_team`), does not include `model`."""
    team = " (its team's models do not include it)" if by_team else ""
    return RouterError(
        403, f"The API key “{key.name}” may not use the model `{model}`{team}.", "model_not_allowed", param="model"
    )


def model_not_in_pools(key: KeyInfo, model: str) -> RouterError:
    """403: no profile of `model` is in one of the key's pools, so no replica may ever serve it."""
    pools = ", ".join(sorted(key.allowed_pools))
    return RouterError(
        403,
        f"The API key “{key.name}” is limited to the pools {pools}, and the model `{model}` runs in none of them.",
        "model_not_in_pools",
        param="model",
    )


def create_app(
    hub: RouterHub | None = None,
    config: RouterConfig | None = None,
    *,
    key_cache: ApiKeyCache | None = None,
    clock: Callable[[], float] = time.time,
    token_store: TokenStore | None = None,
) -> RouterApp:
    """Build a router ASGI app; `app.state` is its RouterState.

    `hub` defaults to hub.get_hub(), `config` to RouterConfig.from_settings();
    `key_cache` and `clock` are for tests; `token_store` for router-only mode (RouterState).
    """
    return RouterApp(
        RouterState(
            get_hub() if hub is None else hub,
            RouterConfig.from_settings() if config is None else config,
            key_cache=key_cache,
            clock=clock,
            token_store=token_store,
        )
    )
