"""Cold start: a request for a model with no ready replica asks for one and waits, bounded.

The same wait holds a request whose model's last replica refused the
connection (its engine or node died): the control plane replaces it, and the
request is answered by the replacement instead of failing.

Many waiters share one activation request (re-asked at most once per
ACTIVATION_INTERVAL in case the first was lost); a key bound to pools asks
for a replica in them, which the control plane starts on a profile of one. Waiters wake on every applied
endpoint table. A streaming client is kept alive with SSE comments while it
waits. Past the bound the answer is 503 with a Retry-After that carries the
start time the control plane learned for the model, less the wait already
spent; a model the control plane cannot place is refused at once with its
reason, and so is one whose only replica failed, with the engine's own last
line (503 `model_failed`) rather than a wait until the deadline. At most `max_waiters` requests wait per model; the next one is refused
at once (503 `too_many_waiting`) rather than holding memory and sockets
without bound. Each hold is timed, by the reason the table last gave for it
(a start unless it said `wake` or `making_room`).

A request for a LoRA adapter that no replica holds is held the same way: the
router asks for the adapter's activation (the control plane starts or wakes
its base if need be and loads it) and goes on as soon as a table lists a
replica holding it. While its base has no ready replica, the base's notes
(unplaceable, failed, its learned start time, why it is held) answer for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable

from hub.contracts import ActivationQueue
from router.background import BackgroundTasks
from router.endpoints.routes import RouteTable
from router.endpoints.table import Endpoint
from router.errors import RouterError
from router.forwarding.asgi_io import Send
from router.metrics import COLD_START, RouterMetrics
from router.picking.affinity import Prefix
from router.picking.picker import Picker

log = logging.getLogger(__name__)

# At most one activation request per model per this many seconds, however many requests wait.
ACTIVATION_INTERVAL = 1.0
KEEPALIVE_COMMENT = b": waiting for a replica of this model to start\n\n"


# A model's first request must be able to wait for its start: a bound below one would refuse every cold start.
# LLMGW_MAX_WAITERS_PER_MODEL's minimum in the settings registry is this number too.
MIN_WAITERS = 1


class ColdStart:
    """Asks the control plane to start models and holds requests until a replica is published."""

    def __init__(
        self,
        hub: ActivationQueue,
        routes: RouteTable,
        picker: Picker,
        metrics: RouterMetrics,
        tasks: BackgroundTasks,
        *,
        activation_timeout: float,
        retry_after: int,
        keepalive_seconds: float,
        max_waiters: int = 1000,
    ):
        if max_waiters < MIN_WAITERS:
            raise ValueError(f"max_waiters must be >= {MIN_WAITERS}, not {max_waiters!r}")
        self.hub = hub
        self.routes = routes
        self.picker = picker
        self.metrics = metrics
        self.tasks = tasks
        self.activation_timeout = activation_timeout
        self.retry_after = retry_after
        # While a streaming request waits, an SSE comment this often keeps the client and any
        # proxy in between from timing out the silent connection.
        self.keepalive_seconds = keepalive_seconds
        self._table_applied = asyncio.Event()
        self._asked: dict[tuple[str, frozenset[str]], float] = {}  # (model, key's pools) -> when last asked
        self.max_waiters = max_waiters
        self._waiting: dict[str, int] = {}

    def waiting(self, model: str) -> int:
        """How many requests wait for a replica of `model` now."""
        return self._waiting.get(model, 0)

    def table_changed(self) -> None:
        """Wake every waiter to look at the table just applied."""
        waiting, self._table_applied = self._table_applied, asyncio.Event()
        waiting.set()

    def _ask_activation(self, model: str, pools: frozenset[str]) -> None:
        """Ask for `model` to be started in `pools` (empty: anywhere), unless asked in the last interval."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        asked = (model, pools)
        if now - self._asked.get(asked, float("-inf")) < ACTIVATION_INTERVAL:
            return
        self._asked[asked] = now
        self.metrics.activations.labels(model).inc()
        # In the background: a slow or unreachable store must not delay noticing the replica.
        self.tasks.start(self._send_activation(model, pools))

    async def _send_activation(self, model: str, pools: frozenset[str]) -> None:
        try:
            await self.hub.request_activation(model, pools)
        except Exception as exc:
            log.warning("could not ask for model %s to be activated: %s", model, exc)

    async def wait_for_endpoint(
        self,
        model: str,
        exclude: Iterable[Endpoint] = (),
        affinity: Prefix | None = None,
        pools: frozenset[str] | None = None,
    ) -> Endpoint | None:
        """Pick a replica of `model` (not one of `exclude`; `affinity` and `pools` as for Picker.pick),
        asking for an activation and waiting (bounded) if it has none.

        Waiters sleep on an event set by each applied table, and re-ask for the
        activation at most once a second in case the first ask was lost.
        """
        endpoint = self.picker.pick(model, exclude, affinity, pools)
        if endpoint is not None:
            return endpoint
        waiting = self._waiting.get(model, 0)
        if waiting >= self.max_waiters:
            raise RouterError(
                503,
                f"Too many requests are waiting for the model `{model}` to start ({waiting}, the most this "
                f"router holds: LLMGW_MAX_WAITERS_PER_MODEL). Retry later.",
                "too_many_waiting",
                type_="server_error",
                headers=[(b"retry-after", str(self.retry_after).encode())],
            )
        self._waiting[model] = waiting + 1
        try:
            return await self._wait(model, exclude, affinity, pools)
        finally:
            left = self._waiting[model] - 1
            if left:
                self._waiting[model] = left
            else:
                del self._waiting[model]

    async def _wait(
        self, model: str, exclude: Iterable[Endpoint], affinity: Prefix | None, pools: frozenset[str] | None
    ) -> Endpoint | None:
        loop = asyncio.get_running_loop()
        began = loop.time()
        deadline = began + self.activation_timeout
        # A start unless a table seen while waiting said otherwise; the last one that said wins (an early table
        # may predate what the control plane knows). Timed only if it waited: one refused at once was not held.
        reason, waited = COLD_START, False
        try:
            while True:
                endpoint = self.picker.pick(model, exclude, affinity, pools)
                if endpoint is not None:
                    return endpoint
                if self.routes.resolve(model) is None:
                    raise RouterError(
                        404, f"The model `{model}` was removed while waiting for it.", "model_not_found", param="model"
                    )
                self._ask_activation(model, pools or frozenset())
                self._raise_if_hopeless(model, pools)
                reason = self.routes.holding(model) or reason
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                waited, table_applied = True, self._table_applied
                try:
                    async with asyncio.timeout(min(remaining, ACTIVATION_INTERVAL)):
                        await table_applied.wait()
                except TimeoutError:
                    pass
        finally:
            if waited:
                self.metrics.traffic.held(model, reason, loop.time() - began)

    def _raise_if_hopeless(self, model: str, pools: frozenset[str] | None) -> None:
        """A RouterError if waiting for `model` (for a key bound to `pools`) would only hold the client until the
        deadline: the control plane cannot place it, or its only replica failed."""
        reason = self.routes.unplaceable(model, pools)
        if reason is not None:
            raise RouterError(
                503,
                f"The model {self._named(model)} cannot be started now: {reason}.",
                "model_unplaceable",
                type_="server_error",
                headers=[(b"retry-after", str(self.retry_after).encode())],
            )
        failure = self.routes.start_failure(model)
        if failure is not None:
            # The engine exited: nothing will be ready before the control plane's backoff ends.
            raise RouterError(
                503,
                f"The model {self._named(model)} has no replica running: its last one failed ({failure}). "
                "The control plane starts it again after a backoff; retry later.",
                "model_failed",
                type_="server_error",
                headers=[(b"retry-after", str(self.retry_after).encode())],
            )

    def _named(self, model: str) -> str:
        """`model` for a message: an adapter's with its base, whose replicas it waits for."""
        base = self.routes.base_of(model)
        return f"`{model}`" if base is None else f"`{model}` (an adapter of `{base}`)"

    async def wait_with_keepalives(
        self,
        send: Send,
        model: str,
        affinity: Prefix | None = None,
        pools: frozenset[str] | None = None,
        exclude: Iterable[Endpoint] = (),
    ) -> Endpoint:
        """Wait for a replica like wait_for_endpoint, sending an SSE comment every keepalive interval."""
        waiter = asyncio.ensure_future(self.wait_for_endpoint(model, exclude, affinity, pools))
        try:
            while not (await asyncio.wait({waiter}, timeout=self.keepalive_seconds))[0]:
                await send({"type": "http.response.body", "body": KEEPALIVE_COMMENT, "more_body": True})
            endpoint = waiter.result()
        finally:
            waiter.cancel()
        if endpoint is None:
            raise self.starting_error(model)
        return endpoint

    def starting_error(self, model: str) -> RouterError:
        """503 for a model still starting past the wait, with Retry-After as the learned ETA if known."""
        retry_after = self.retry_after
        learned = self.routes.start_seconds(model)
        if learned is not None:
            # The ETA: what a start usually takes, less what this request already waited.
            retry_after = max(1, math.ceil(learned - self.activation_timeout))
        return RouterError(
            503,
            f"The model {self._named(model)} is starting; no replica became ready within "
            f"{self.activation_timeout:g} s. Retry later.",
            "model_starting",
            type_="server_error",
            headers=[(b"retry-after", str(retry_after).encode())],
        )
