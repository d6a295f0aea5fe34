"""The router: a hand-written ASGI app that proxies OpenAI requests to ready engine replicas.

No Django request cycle runs here; Django is used only for settings and, on an
API-key cache miss, the ORM. One aiohttp ClientSession (made at lifespan
startup) carries every upstream request. The endpoint table arrives from the
hub (the `hub` package): pushed through `watch_endpoints()`, re-read every
LLMGW_ROUTER_POLL_SECONDS as a backstop (DESIGN invariant 7). Last-use stamps
are kept in memory and flushed to the hub every LLMGW_USAGE_FLUSH_SECONDS
(DESIGN invariant 4).

`create_app()` builds an app; `app.state` (a RouterState) is what the embedded
`up` command and tests inspect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time

import aiohttp

from .balancer import Balancer, Endpoint, TableError
from .keys import ApiKeyCache
from .metrics import UNKNOWN_MODEL, RouterMetrics

log = logging.getLogger(__name__)

PROXY_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
JSON_CONTENT_TYPE = (b"content-type", b"application/json")
# Headers of an engine's response that mean the same thing to our client; hop-by-hop ones are not copied.
PASSED_RESPONSE_HEADERS = frozenset({"content-type", "content-length", "content-encoding", "cache-control"})
RETRIABLE_STATUSES = frozenset({502, 503})
# nginx's convention for "the client closed the request"; only ever a metric label.
CLIENT_CLOSED = 499
REPLICA_HEADER = b"x-llmgw-replica"
# At most one activation request per model per this many seconds, however many requests wait.
ACTIVATION_INTERVAL = 1.0


def error_body(message: str, type_: str, code: str | None, param: str | None = None) -> bytes:
    """An error in OpenAI's shape."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
KEEPALIVE_COMMENT = b": waiting for a replica of this model to start\n\n"


class RouterError(Exception):
    """A request the router answers itself, with an HTTP status and an OpenAI-shaped error."""

    def __init__(self, status: int, message: str, code: str, *, type_: str = "invalid_request_error",
                 param: str | None = None, headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, type_, param
        self.headers = headers or []

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)


class RouterState:
    """Everything one router app keeps in memory: table, balancer, key cache, metrics, session, tasks."""

    def __init__(self, hub, *, activation_timeout: float, poll_seconds: float, flush_seconds: float,
                 connect_timeout: float, read_timeout: float, retry_after: int, max_body_bytes: int,
                 key_cache: ApiKeyCache | None = None, keepalive_seconds: float = 10.0):
        if activation_timeout < 0 or poll_seconds <= 0 or flush_seconds <= 0:
            raise ValueError("activation_timeout must be >= 0; poll_seconds and flush_seconds must be > 0")
        if connect_timeout <= 0 or read_timeout <= 0:
            raise ValueError("connect_timeout and read_timeout must be > 0")
        self.hub = hub
        self.activation_timeout = activation_timeout
        self.poll_seconds = poll_seconds
        self.flush_seconds = flush_seconds
        # Long enough to survive a late flush or two, short enough that a dead router is noticed.
        self.watch_ttl = max(3 * flush_seconds, 3.0)
        self.retry_after = retry_after
        self.max_body_bytes = max_body_bytes
        # While a streaming request waits for a cold start, an SSE comment this often keeps
        # the client and any proxy in between from timing out the silent connection.
        self.keepalive_seconds = keepalive_seconds
        # Per-phase deadlines only: a stream may run as long as the engine keeps sending.
        self.upstream_timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout)
        self.balancer = Balancer()
        self.keys = key_cache or ApiKeyCache()
        self.metrics = RouterMetrics()
        self.session: aiohttp.ClientSession | None = None
        self.started = False
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._table_applied = asyncio.Event()
        self._activation_asked: dict[str, float] = {}
        self._usage_failing = False
        self._poll_failing = False

    # -- lifecycle --------------------------------------------------------------
    async def start(self) -> None:
        """Open the upstream session, load the table and start the watcher, poller and usage flusher."""
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0,
                # Below uvicorn's 5 s keep-alive, so we rarely reuse a connection the engine is closing.
                keepalive_timeout=4.0,
            ),
            timeout=self.upstream_timeout,
            # Bytes go to the client as the engine sent them; Accept-Encoding is the client's own.
            auto_decompress=False,
        )
        self._tasks.append(asyncio.create_task(self._watch(), name="router-watch-endpoints"))
        # Let the watcher subscribe before reading, so a table published in between is not missed.
        await asyncio.sleep(0)
        try:
            table = await self.hub.read_endpoints()
        except Exception as exc:  # the store being down must not stop the router; the poller retries
            log.warning("could not read the endpoint table at startup, will retry: %s", exc)
            table = None
        if table is not None:
            self.apply_table(table)
        self._tasks.append(asyncio.create_task(self._poll(), name="router-poll-endpoints"))
        self._tasks.append(asyncio.create_task(self._flush_loop(), name="router-flush-usage"))
        self.started = True

    async def stop(self) -> None:
        """Cancel the background tasks, flush the last stamps (briefly) and close the session."""
        self.started = False
        tasks = self._tasks + list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        try:
            async with asyncio.timeout(2.0):
                await self.flush_usage()
        except TimeoutError:
            log.warning("usage store did not take the last stamps before shutdown")
        if self.session is not None:
            await self.session.close()
            self.session = None
        await self.keys.close()

    # -- the endpoint table -----------------------------------------------------
    def apply_table(self, table: dict) -> bool:
        """Install a table (on the router's loop); wake requests waiting for a replica if it changed."""
        try:
            changed = self.balancer.apply_table(table)
        except TableError as exc:
            log.error("ignoring a malformed endpoint table: %s", exc)
            return False
        if changed:
            log.info("endpoint table: %d models, %d ready endpoints",
                     len(self.balancer.catalog()), len(self.balancer.endpoints()))
            waiting, self._table_applied = self._table_applied, asyncio.Event()
            waiting.set()
        return changed

    async def _watch(self) -> None:
        while True:
            try:
                async for table in self.hub.watch_endpoints():
                    self.apply_table(table)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                _raise_if_cancelling()
                log.warning("endpoint watch failed, the poller covers the gap: %s", exc)
            await asyncio.sleep(self.poll_seconds)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                table = await self.hub.read_endpoints()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                _raise_if_cancelling()
                if not self._poll_failing:
                    log.warning("could not re-read the endpoint table: %s", exc)
                    self._poll_failing = True
                continue
            self._poll_failing = False
            if table is not None:
                self.apply_table(table)

    # -- last-use stamps ------------------------------------------------------------
    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            await self.flush_usage()
            _raise_if_cancelling()

    async def flush_usage(self) -> bool:
        """Hand the stamps gathered since the last flush to the hub; keep them if it refuses.

        Then renew the hub's "watching" mark: a router whose stamps are being
        delivered vouches that a replica without a stamp was not used. A failed
        flush renews nothing, so the mark lapses and unused means unknown again.
        """
        stamps = self.balancer.take_stamps()
        try:
            if stamps:
                await self.hub.record_usage(stamps)
            await self.hub.keep_watching(self.watch_ttl)
        except asyncio.CancelledError:
            self.balancer.restore_stamps(stamps)
            raise
        except Exception as exc:  # Redis down must never fail a request (DESIGN invariant 4)
            self.balancer.restore_stamps(stamps)
            self.metrics.usage_flush_failures.inc()
            if not self._usage_failing:
                log.warning("could not record last-use stamps, keeping them for the next flush: %s", exc)
                self._usage_failing = True
            return False
        if self._usage_failing:
            log.info("usage store is taking last-use stamps again")
            self._usage_failing = False
        return True

    # -- cold start -------------------------------------------------------------------
    def _ask_activation(self, model: str) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._activation_asked.get(model, float("-inf")) < ACTIVATION_INTERVAL:
            return
        self._activation_asked[model] = now
        self.metrics.activations.labels(model).inc()
        # In the background: a slow or unreachable store must not delay noticing the replica.
        task = loop.create_task(self._send_activation(model))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_activation(self, model: str) -> None:
        try:
            await self.hub.request_activation(model)
        except Exception as exc:
            log.warning("could not ask for model %s to be activated: %s", model, exc)

    async def wait_for_endpoint(self, model: str) -> Endpoint | None:
        """Pick a replica of `model`, asking for an activation and waiting (bounded) if it has none.

        Waiters sleep on an event set by each applied table, and re-ask for the
        activation at most once a second in case the first ask was lost.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.activation_timeout
        while True:
            endpoint = self.balancer.pick(model)
            if endpoint is not None:
                return endpoint
            if self.balancer.resolve(model) is None:
                raise RouterError(404, f"The model `{model}` was removed while waiting for it.", "model_not_found",
                                  param="model")
            self._ask_activation(model)
            reason = self.balancer.unplaceable(model)
            if reason is not None:
                # Waiting would only hold the client until the deadline: say why now.
                raise RouterError(
                    503, f"The model `{model}` cannot be started now: {reason}.", "model_unplaceable",
                    type_="server_error", headers=[(b"retry-after", str(self.retry_after).encode())],
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                return None
            table_applied = self._table_applied
            try:
                async with asyncio.timeout(min(remaining, ACTIVATION_INTERVAL)):
                    await table_applied.wait()
            except TimeoutError:
                pass


class RouterApp:
    """The ASGI callable. Routes: the OpenAI proxy paths, /v1/models, /health, /metrics."""

    def __init__(self, state: RouterState):
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "websocket":
            await receive()
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive, send) -> None:
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

    # -- dispatch -----------------------------------------------------------------------
    async def _http(self, scope, receive, send) -> None:
        path, method = scope["path"], scope["method"]
        try:
            if path in PROXY_PATHS:
                if method != "POST":
                    raise _method_not_allowed(method, path, b"POST")
                await self._proxy(scope, receive, send, path)
            elif path == "/v1/models":
                if method != "GET":
                    raise _method_not_allowed(method, path, b"GET")
                await self._authorize(scope)
                await _send_json(send, 200, self._model_list())
            elif path == "/health":
                await _send_json(send, 200, self._health())
            elif path == "/metrics":
                await _send_bytes(send, 200, self.state.metrics.render(), self.state.metrics.content_type.encode())
            else:
                raise RouterError(404, f"Unknown path: {method} {path}", "not_found")
        except RouterError as exc:
            await _send_bytes(send, exc.status, exc.body(), JSON_CONTENT_TYPE[1], exc.headers)

    def _model_list(self) -> dict:
        data = []
        for public, aliases in sorted(self.state.balancer.catalog().items()):
            for name in (public, *aliases):
                data.append({"id": name, "object": "model", "created": 0, "owned_by": "llmgw", "root": public})
        return {"object": "list", "data": data}

    def _health(self) -> dict:
        balancer = self.state.balancer
        return {
            "status": "ok",
            "models": len(balancer.catalog()),
            "endpoints": len(balancer.endpoints()),
            "in_flight": balancer.in_flight(),
            "table": balancer.fingerprint,
        }

    async def _authorize(self, scope) -> None:
        header = None
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
        try:
            valid = await self.state.keys.is_valid(key)
        except Exception:
            log.exception("could not verify an API key")
            raise RouterError(503, "The API key could not be verified right now; try again.", "key_check_unavailable",
                              type_="server_error") from None
        if not valid:
            raise RouterError(401, "Invalid API key (unknown or revoked).", "invalid_api_key")

    # -- the proxy ------------------------------------------------------------------------
    async def _proxy(self, scope, receive, send, path: str) -> None:
        metrics = self.state.metrics
        model = UNKNOWN_MODEL
        try:
            await self._authorize(scope)
            body = await self._read_body(receive)
            if body is None:
                metrics.requests.labels(model, str(CLIENT_CLOSED)).inc()
                return
            model, body, streaming = self._parse(body)
        except RouterError as exc:
            metrics.requests.labels(model, str(exc.status)).inc()
            raise

        outcome = _Outcome()
        forward = asyncio.ensure_future(self._forward(scope, send, path, model, body, outcome, streaming))
        # The client may go away while we wait for a replica or stream: then stop the upstream request.
        gone = asyncio.ensure_future(_until_disconnect(receive))
        metrics.in_flight.inc()
        try:
            done, _ = await asyncio.wait((forward, gone), return_when=asyncio.FIRST_COMPLETED)
            if forward in done:
                gone.cancel()
                forward.result()
            else:
                # A disconnect reported after the response was complete is just the end of the exchange.
                if not outcome.complete:
                    outcome.status = CLIENT_CLOSED
                forward.cancel()
                await asyncio.gather(forward, return_exceptions=True)
        except RouterError as exc:
            outcome.status = exc.status
            raise
        except BaseException:
            forward.cancel()
            gone.cancel()
            outcome.status = outcome.status or 500
            raise
        finally:
            metrics.in_flight.dec()
            metrics.requests.labels(model, str(outcome.status or CLIENT_CLOSED)).inc()

    async def _read_body(self, receive) -> bytes | None:
        """The whole request body, or None if the client left before sending it."""
        chunks = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.state.max_body_bytes:
                raise RouterError(413, f"Request body is larger than {self.state.max_body_bytes} bytes.",
                                  "body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _parse(self, body: bytes) -> tuple[str, bytes, bool]:
        """(public model name, body for the engine, whether it streams), or a RouterError naming the problem."""
        try:
            payload = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RouterError(400, f"Request body is not valid JSON: {exc}", "invalid_json") from None
        if not isinstance(payload, dict):
            raise RouterError(400, f"Request body must be a JSON object, not {type(payload).__name__}.",
                              "invalid_body")
        requested = payload.get("model")
        if not isinstance(requested, str) or not requested:
            raise RouterError(400, "Request body must have a non-empty string \"model\".", "missing_model",
                              param="model")
        public = self.state.balancer.resolve(requested)
        if public is None:
            raise RouterError(404, f"The model `{requested}` does not exist.", "model_not_found", param="model")
        if public != requested:
            # Engines serve under the public name only.
            payload["model"] = public
            body = json.dumps(payload).encode()
        return public, body, payload.get("stream") is True

    async def _forward(self, scope, send, path: str, model: str, body: bytes, outcome: _Outcome,
                       streaming: bool = False) -> None:
        state = self.state
        if state.session is None:
            raise RouterError(503, "The router is not started.", "router_not_started", type_="server_error")
        endpoint = state.balancer.pick(model)
        if endpoint is None and streaming and state.keepalive_seconds > 0:
            # Answer at once and keep the stream alive while the model starts. From here on an
            # error can only travel inside the stream, as an OpenAI error event.
            await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
            outcome.status = 200
            try:
                endpoint = await self._wait_with_keepalives(send, model)
                await self._send_upstream(scope, send, path, model, body, outcome, endpoint, headers_sent=True)
            except RouterError as exc:
                outcome.status = exc.status
                await send({"type": "http.response.body", "body": b"data: " + exc.body() + b"\n\n",
                            "more_body": False})
            return
        if endpoint is None:
            endpoint = await state.wait_for_endpoint(model)
            if endpoint is None:
                raise self._starting_error(model)
        await self._send_upstream(scope, send, path, model, body, outcome, endpoint, headers_sent=False)

    def _starting_error(self, model: str) -> RouterError:
        state = self.state
        retry_after = state.retry_after
        learned = state.balancer.start_seconds(model)
        if learned is not None:
            # The ETA: what a start usually takes, less what this request already waited.
            retry_after = max(1, math.ceil(learned - state.activation_timeout))
        return RouterError(
            503, f"The model `{model}` is starting; no replica became ready within "
            f"{state.activation_timeout:g} s. Retry later.", "model_starting", type_="server_error",
            headers=[(b"retry-after", str(retry_after).encode())],
        )

    async def _wait_with_keepalives(self, send, model: str) -> Endpoint:
        """Wait for a replica like wait_for_endpoint, sending an SSE comment every keepalive interval."""
        waiter = asyncio.ensure_future(self.state.wait_for_endpoint(model))
        try:
            while not (await asyncio.wait({waiter}, timeout=self.state.keepalive_seconds))[0]:
                await send({"type": "http.response.body", "body": KEEPALIVE_COMMENT, "more_body": True})
            endpoint = waiter.result()
        finally:
            waiter.cancel()
        if endpoint is None:
            raise self._starting_error(model)
        return endpoint

    async def _send_upstream(self, scope, send, path: str, model: str, body: bytes, outcome: _Outcome,
                             endpoint: Endpoint, *, headers_sent: bool) -> None:
        """Send the request to `endpoint` (retrying once on another replica before any upstream byte
        is relayed) and relay the answer."""
        state = self.state
        headers = _upstream_headers(scope)
        tried: list[str] = []
        while True:
            tried.append(endpoint.replica_id)
            retry_possible = len(tried) == 1
            try:
                started = time.perf_counter()
                response = await state.session.post(endpoint.url + path, data=body, headers=headers)
            except (aiohttp.ConnectionTimeoutError, aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError,
                    aiohttp.ClientOSError) as exc:
                state.balancer.release(endpoint)
                log.warning("replica %s of %s failed before responding: %r", endpoint.replica_id, model, exc)
                nxt = state.balancer.pick(model, exclude=tried) if retry_possible else None
                if nxt is None:
                    raise RouterError(502, f"No replica of `{model}` could be reached.", "upstream_unavailable",
                                      type_="server_error") from None
                state.metrics.retries.labels(model).inc()
                endpoint = nxt
                continue
            except (aiohttp.SocketTimeoutError, TimeoutError):
                state.balancer.release(endpoint)
                raise RouterError(504, f"Replica {endpoint.replica_id} of `{model}` did not answer in time.",
                                  "upstream_timeout", type_="server_error") from None
            except BaseException:
                state.balancer.release(endpoint)
                raise
            state.metrics.upstream_latency.labels(model).observe(time.perf_counter() - started)
            if response.status in RETRIABLE_STATUSES and retry_possible:
                nxt = state.balancer.pick(model, exclude=tried)
                if nxt is not None:
                    response.close()
                    state.balancer.release(endpoint)
                    state.metrics.retries.labels(model).inc()
                    endpoint = nxt
                    continue
            if headers_sent and response.status != 200:
                # The client already has a 200 and a stream: carry the engine's error inside it.
                detail = (await response.content.read(64 * 1024)).decode("utf-8", "replace")
                response.close()
                state.balancer.release(endpoint)
                raise RouterError(response.status, f"Replica {endpoint.replica_id} of `{model}` answered "
                                  f"{response.status}: {detail}", "upstream_error", type_="server_error")
            await self._relay(send, endpoint, response, outcome, headers_sent=headers_sent)
            return

    async def _relay(self, send, endpoint: Endpoint, response: aiohttp.ClientResponse, outcome: _Outcome,
                     *, headers_sent: bool = False) -> None:
        """Stream the engine's response to the client chunk by chunk; never retried once started."""
        clean = False
        try:
            if not headers_sent:
                headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()
                           if k.lower() in PASSED_RESPONSE_HEADERS]
                headers.append((REPLICA_HEADER, endpoint.replica_id.encode()))
                await send({"type": "http.response.start", "status": response.status, "headers": headers})
            outcome.status = response.status
            try:
                async for chunk in response.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Too late to retry or change the status: end without completing, so the client sees a cut.
                log.warning("replica %s of %s failed mid-response: %r", endpoint.replica_id, endpoint.model, exc)
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            outcome.complete = True
            clean = True
        finally:
            if clean:
                response.release()
            else:
                # Closing (not pooling) the connection is what makes the engine stop generating.
                response.close()
            self.state.balancer.release(endpoint)


def _raise_if_cancelling() -> None:
    """Honour a cancellation that a store client turned into an error of its own.

    redis-py can answer a cancelled read with a connection error; a background
    loop that logs it and carries on would never end, and shutdown would hang.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class _Outcome:
    """What a proxied request ended as, for the metrics."""

    __slots__ = ("status", "complete")

    def __init__(self):
        self.status: int | None = None
        self.complete = False


async def _until_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _upstream_headers(scope) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
    for name, value in scope["headers"]:
        if name == b"accept":
            headers["Accept"] = value.decode("latin-1")
        elif name == b"accept-encoding":
            headers["Accept-Encoding"] = value.decode("latin-1")
        elif name == b"x-request-id":
            headers["X-Request-Id"] = value.decode("latin-1")
    return headers


def _method_not_allowed(method: str, path: str, allowed: bytes) -> RouterError:
    return RouterError(405, f"Method {method} is not allowed on {path}; use {allowed.decode()}.",
                       "method_not_allowed", headers=[(b"allow", allowed)])


async def _send_bytes(send, status: int, body: bytes, content_type: bytes,
                      extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send, status: int, payload: dict) -> None:
    await _send_bytes(send, status, json.dumps(payload).encode(), JSON_CONTENT_TYPE[1])


def create_app(hub=None, *, activation_timeout: float | None = None, poll_seconds: float | None = None,
               flush_seconds: float | None = None, connect_timeout: float = 5.0, read_timeout: float = 600.0,
               retry_after: int = 10, max_body_bytes: int = 64 * 1024 * 1024,
               key_cache: ApiKeyCache | None = None, keepalive_seconds: float = 10.0) -> RouterApp:
    """Build a router ASGI app; `app.state` is its RouterState.

    `hub` defaults to hub.get_hub(). Timeouts default to the
    LLMGW_* settings. `read_timeout` bounds the silence between bytes from an
    engine (including before the first byte of a non-streamed answer), never a
    whole stream.
    """
    from django.conf import settings

    if hub is None:
        from hub import get_hub

        hub = get_hub()
    state = RouterState(
        hub,
        activation_timeout=(settings.LLMGW_ACTIVATION_TIMEOUT_SECONDS if activation_timeout is None
                            else activation_timeout),
        poll_seconds=settings.LLMGW_ROUTER_POLL_SECONDS if poll_seconds is None else poll_seconds,
        flush_seconds=settings.LLMGW_USAGE_FLUSH_SECONDS if flush_seconds is None else flush_seconds,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retry_after=retry_after,
        max_body_bytes=max_body_bytes,
        key_cache=key_cache,
        keepalive_seconds=keepalive_seconds,
    )
    return RouterApp(state)
