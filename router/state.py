"""What one router app keeps in memory, and its lifecycle.

RouterState holds the router's parts (route table, ledger, picker, API-key
cache, metrics, usage flusher, cold start, proxy, background tasks), starts and stops them
with the ASGI lifespan, and keeps the endpoint table in sync with the hub:
pushed through `watch_endpoints()`, re-read every `config.poll_seconds` as a
backstop (DESIGN invariant 7).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from hub.contracts import RouterHub
from hub.gc_tuning import tune_gc
from router.accounting.budgets import BudgetGate
from router.accounting.flusher import UsageFlusher
from router.accounting.ledger import Ledger
from router.accounting.store import TokenStore
from router.accounting.windows import RecentWindows
from router.background import BackgroundTasks, raise_if_cancelling
from router.config import RouterConfig
from router.endpoints.routes import RouteTable
from router.endpoints.table import TableError, decode_table
from router.forwarding.admission import AdmissionCollector
from router.forwarding.coldstart import ColdStart
from router.forwarding.inflight import InFlight
from router.forwarding.proxy import Proxy
from router.forwarding.tracing import TracedPicker, TracingHooks
from router.key_cache import ApiKeyCache
from router.metrics import RouterMetrics
from router.picking.engine_load import EngineLoadPoller
from router.picking.picker import Picker

log = logging.getLogger(__name__)


class RouterState:
    """Everything one router app keeps in memory: route table, ledger, picker, key cache, metrics, session, tasks,
    and the gate of budgets (reservations at admission, settlements at each answer's end)."""

    def __init__(
        self,
        hub: RouterHub,
        config: RouterConfig,
        *,
        key_cache: ApiKeyCache | None = None,
        clock: Callable[[], float] = time.time,
        token_store: TokenStore | None = None,
    ):
        """`clock`: wall time (stamps, rate limits' minute); `token_store`: router-only mode's, None in a fleet."""
        self.hub, self.config, self.clock, self.token_store = hub, config, clock, token_store
        self.routes = RouteTable()
        self.ledger = Ledger(self.routes, clock, records=config.request_records)
        tracer = config.tracer
        self.picker = _picker(self.routes, self.ledger, config)
        self.engine_load = EngineLoadPoller(self.routes, self.picker)
        self.keys = key_cache or ApiKeyCache()
        self.metrics = RouterMetrics(self.routes, self.picker)
        self.tasks = BackgroundTasks()
        self.usage = UsageFlusher(hub, self.ledger, self.metrics, config.flush_seconds, config.router_id)
        self.cold_start = ColdStart(
            hub,
            self.routes,
            self.picker,
            self.metrics,
            self.tasks,
            activation_timeout=config.activation_timeout,
            retry_after=config.retry_after,
            keepalive_seconds=config.keepalive_seconds,
            max_waiters=config.max_waiters,
        )
        hooks = None if tracer is None else TracingHooks(tracer, self.routes)
        self.budgets = BudgetGate(hub, config.budget_reservation_seconds, config.budget_output_tokens, clock)
        self.proxy = Proxy(self.picker, self.ledger, self.metrics, self.cold_start, config, hooks, self.budgets)
        self.metrics.registry.register(AdmissionCollector(self.proxy.admission))
        self.engine_load.polled = self.proxy.admission.polled
        self.usage.windows = RecentWindows(self.metrics.traffic, self.proxy.admission, config.latency_window_seconds)
        # Requests being proxied, watched for an overdue first byte and for clients that leave.
        self.in_flight = InFlight(self.tasks, config.first_byte_timeout, config.idle_timeout)
        self.started = False
        # Set when the server is told to stop: new requests get 503 while in-flight ones finish.
        self.draining = False
        self._poll_failing = False

    async def start(self) -> None:
        """Open the upstream session, load the table and start the watcher, poller and usage flusher."""
        self.proxy.open()
        tune_gc()
        self.tasks.start(self._watch(), name="router-watch-endpoints")
        # Let the watcher subscribe before reading, so a table published in between is not missed.
        await asyncio.sleep(0)
        try:
            table = await self.hub.read_endpoints()
        except Exception as exc:  # the store being down must not stop the router; the poller retries
            log.warning("could not read the endpoint table at startup, will retry: %s", exc)
            table = None
        if table is not None:
            self.apply_table(table)
        self.tasks.start(self._poll(), name="router-poll-endpoints")
        self.tasks.start(self.usage.run(), name="router-flush-usage")
        if self.token_store is not None:
            self.tasks.start(self.token_store.run(), name="router-store-tokens")
        self.tasks.start(self.engine_load.run(), name="router-poll-engine-load")
        # Revoked and edited keys are dropped from the cache as the control plane publishes them.
        self.tasks.start(self.keys.follow(self.hub), name="router-watch-key-changes")
        # The id the control plane names when this router's usage reports stop ("router X has not reported…").
        log.info("router %s reports usage every %g s", self.usage.router_id, self.usage.flush_seconds)
        self.started = True

    def begin_drain(self) -> None:
        """Refuse new requests from now on (503 shutting_down); those in flight carry on."""
        if not self.draining:
            self.draining = True
            log.info("router draining: new requests are refused while %d in flight finish", self.ledger.in_flight())

    async def stop(self) -> None:
        """Cancel the background tasks, flush the last usage and leave (briefly), and close the session."""
        self.started = False
        await self.tasks.cancel_all()
        await self.budgets.close()  # settlements before the last usage flush
        try:
            async with asyncio.timeout(2.0):
                await self.usage.close()
        except TimeoutError:
            log.warning("usage store did not take the last usage report before shutdown")
        if self.token_store is not None:
            # After the last flush: what it handed the hub is stored too.
            await self.token_store.close()
        await self.proxy.close()
        await self.keys.close()

    def apply_table(self, table: bytes) -> bool:
        """Install a table as the hub hands it over (on the router's loop); wake requests waiting for a replica
        if it changed."""
        try:
            changed = self.routes.apply_table(decode_table(table))
        except TableError as exc:
            log.error("ignoring a malformed endpoint table: %s", exc)
            return False
        if changed:
            log.info(
                "endpoint table: %d models, %d adapters, %d ready endpoints",
                len(self.routes.catalog()),
                len(self.routes.adapters()),
                len(self.routes.by_replica),
            )
            self.cold_start.table_changed()
            self.proxy.moves.plan(self.routes.moving)
        return changed

    async def _watch(self) -> None:
        while True:
            try:
                async for table in self.hub.watch_endpoints():
                    self.apply_table(table)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise_if_cancelling()
                log.warning("endpoint watch failed, the poller covers the gap: %s", exc)
            await asyncio.sleep(self.config.poll_seconds)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.poll_seconds)
            try:
                table = await self.hub.read_endpoints()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                raise_if_cancelling()
                if not self._poll_failing:
                    log.warning("could not re-read the endpoint table: %s", exc)
                    self._poll_failing = True
                continue
            self._poll_failing = False
            if table is not None:
                self.apply_table(table)


def _picker(routes: RouteTable, ledger: Ledger, config: RouterConfig) -> Picker:
    """The router's picker. With traces on, picks are spans and the proxy's steps run inside spans
    (router.forwarding.tracing); without, not a line of it runs."""
    tracer = config.tracer
    picker = (Picker if tracer is None else TracedPicker)(
        routes,
        ledger,
        ejection=config.ejection,
        kv_full_fraction=config.kv_full_fraction,
        affinity_slack=config.affinity_slack,
    )
    if isinstance(picker, TracedPicker):
        picker.tracer = tracer
    return picker
