"""Admission at saturation: when a model's replicas run all they can, its requests wait in this router's fair queue
(router.picking.fair_queue) instead of an engine's first come, first served, and leave it as capacity frees.

A replica is full when this router has `capacity` requests on it (the profile's `max_concurrency`), or when its
engine reported requests waiting in its own queue at the last poll (other routers filled it) while this router has
some on it already. A replica without a capacity is never full: below saturation, and for models without a
capacity, a request pays one attribute read (`Endpoint.capacity`) and nothing more.

The request picked a replica first (router.picking.picker); it waits instead when that replica is full, or when
its tenant (its key's team, or the key) already runs its limit of what its class may use of the model: the classes
above it keep room for their recent peaks, and a class's tenants share the rest by weight (router.picking.shares);
batch, the last class, is so served from spare room only. Then the pick is given back and the request waits
in the model's queue, ordered by class (its key's, lowered by an `LLMGW-Priority` header, never raised), then its
tenant's weighted share of tokens, then arrival (router.picking.fair_queue). Room frees when a request on the model
ends (`Picker.release` and `ended` call `freed`) and when an engine poll finds its queue empty (`polled`): the queue
hands out the best waiting requests allowed to start while a replica has room, each with its replica picked and
counted, so a request arriving meanwhile cannot take the room first.

Bounds, per tenant and model in each router: LLMGW_QUEUE_MAX_WAITING requests waiting (past it, 429 with
Retry-After from the queue's pace) and LLMGW_QUEUE_MAX_WAIT_SECONDS of waiting (past it, 503 naming the wait). A
stream that waits longer than a keep-alive interval is answered 200 and hears keep-alives, as in a cold start.

Each router queues alone, on a 1/N share of each replica's capacity (N: the routers reporting usage, as the hub
counts them for keys' rate limits), so together they never commit more than the capacity to an engine. Clients
spread over the routers at random give each about 1/N of every tenant's requests, so each router's order, fair over
what it sees, is fair over all of them to within what the spread leaves uneven: a tenant's requests at one router
in a window differ from 1/N of its total by about their square root (bench/fair_share_bench.py --routers 2).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hub.priority import NAMES, RANKS, STANDARD
from hub.windows import QUEUE_WAIT_BUCKETS
from router.endpoints.table import Endpoint
from router.errors import RouterError
from router.forwarding.asgi_io import Scope
from router.forwarding.exchange import Forwarding
from router.forwarding.headers import SSE_HEADERS
from router.metrics import Histogram
from router.picking.fair_queue import FairQueue, QueueFull, Waiting
from router.picking.picker import Picker
from router.picking.shares import ModelShares, Use

if TYPE_CHECKING:
    from router.key_cache import KeyInfo

KEEPALIVE_COMMENT = b": waiting for capacity of this model\n\n"
PRIORITY_HEADER = b"llmgw-priority"
NO_TEAM = "(no team)"


class _Model:
    """One model's queue, and who runs and waits on it."""

    __slots__ = ("queue", "shares")

    def __init__(self, queue: FairQueue) -> None:
        self.queue = queue
        self.shares = ModelShares()


class Admission:
    """Each model's fair queue in this router, and the decision whether a request waits (see the module docstring).
    Used on the router's event loop only."""

    def __init__(
        self,
        picker: Picker,
        *,
        max_waiting: int,
        max_wait_seconds: float,
        keepalive_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_waiting < 1 or not max_wait_seconds > 0 or keepalive_seconds < 0:
            raise ValueError("max_waiting must be >= 1, max_wait_seconds > 0 and keepalive_seconds >= 0")
        self.picker = picker
        self.max_waiting, self.max_wait_seconds = max_waiting, max_wait_seconds
        self.keepalive_seconds = keepalive_seconds
        self._clock = clock
        self.models: dict[str, _Model] = {}
        self.waits = Histogram(
            "llmgw_router_queue_wait_seconds",
            "How long requests waited in a full model's fair queue, by class, observed when they left it (served, "
            "refused or the client gone).",
            ("model", "class"),
            QUEUE_WAIT_BUCKETS,
        )
        self.refused: dict[tuple[str, str, str], int] = {}  # (model, class, why) -> requests refused
        self.served_tokens: dict[tuple[str, str], int] = {}  # (model, team) -> tokens of answers that waited
        self.weights: dict[str, int] = {}  # team -> its weight, as last seen
        self._freeing = False
        picker.freed = self.freed

    # -- the request's side -----------------------------------------------------------
    def must_wait(self, endpoint: Endpoint, request: Forwarding) -> bool:
        """Whether `request`, which picked `endpoint` (a replica with a capacity), must wait for room instead;
        if not, it is counted as running on its model."""
        state = self.models.get(request.model) or self._model(request.model)
        shares = state.shares
        shares.rotate(self._clock())
        tenant, weight = _tenant(request)
        use = shares.tenant(tenant, _priority(request), weight)
        if self._full(endpoint) or not self._has_room(request.model, shares, use):
            return True
        _start(request, use)
        return False

    async def wait(self, request: Forwarding, picked: Endpoint) -> Endpoint:
        """Give back `picked` and wait in the model's queue for a replica with room; the replica, counted, or a
        RouterError: 429 past the tenant's queue bound, 503 past its wait bound."""
        model = request.model
        priority = _priority(request)
        self.picker.release(picked, None, model)
        state = self.models.get(model) or self._model(model)
        tenant, weight = _tenant(request)
        future: asyncio.Future[Endpoint] = asyncio.get_running_loop().create_future()
        try:
            entry = state.queue.push((future, request), tenant, priority, weight)
        except QueueFull as full:
            self._refuse(model, priority, "full")
            raise queue_full(model, request.key, full) from None
        state.queue.forget_idle()  # (each waiter leaves at its own deadline: `_granted`'s timeout)
        use = state.shares.tenant(tenant, priority, weight)
        use.waiting += 1
        use.saw()
        self.picker.ledger.waiting(model, +1)
        try:
            endpoint = await self._granted(request, future)
        except BaseException as exc:
            self._gave_up(state, entry, future)
            if isinstance(exc, TimeoutError):
                self._refuse(model, priority, "timeout")
                raise queue_timeout(model, self._clock() - entry.arrived) from None
            raise
        waited = self._waited(model, entry)
        request.waited, request.queue_wait = entry, b"%.3f" % waited
        return endpoint

    def _gave_up(self, state: _Model, entry: Waiting, future: asyncio.Future[Endpoint]) -> None:
        """A waiter left (timed out, or its client went away): out of the queue; a replica granted as it left is
        given back (its count on the model ends with the request, `ended`)."""
        _, request = entry.item
        if state.queue.remove(entry):
            state.shares.tenant(entry.tenant, entry.priority, _tenant(request)[1]).waiting -= 1
            self.picker.ledger.waiting(request.model, -1)
        elif future.done() and not future.cancelled() and future.exception() is None:
            self.picker.release(future.result(), None, request.model)
        self._waited(request.model, entry)

    async def _granted(self, request: Forwarding, future: asyncio.Future[Endpoint]) -> Endpoint:
        """The replica `future` is granted, within the wait bound; a stream still waiting after a keep-alive
        interval is answered 200 and hears keep-alives meanwhile."""
        async with asyncio.timeout(self.max_wait_seconds):
            interval = self.keepalive_seconds
            if not (request.streaming and interval > 0):
                return await future
            done, _ = await asyncio.wait({future}, timeout=interval)
            if done:
                return future.result()
            if not request.headers_sent:
                await request.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
                request.exchange.status = 200
                request.headers_sent = True
            while not (await asyncio.wait({future}, timeout=interval))[0]:
                await request.send({"type": "http.response.body", "body": KEEPALIVE_COMMENT, "more_body": True})
            return future.result()

    def ended(self, request: Forwarding) -> None:
        """`request` is over (in any way): its count on the model ends (room for the queue), and its tenant is
        charged the tokens it was served."""
        use, request.admitted = request.admitted, None
        state = self.models.get(request.model)
        if use is not None:
            use.running -= 1
            self.freed(request.model)
        entry, request.waited = request.waited, None
        if entry is not None:
            usage = request.exchange.usage
            tokens = int(entry.charged) if usage is None else usage[0] + usage[1]
            if state is not None:
                state.queue.served(entry, tokens)
            key, team = request.key, NO_TEAM
            if key is not None and key.team_id is not None:
                team = key.tenant
                self.weights[team] = key.weight
            counted = (request.model, team)
            self.served_tokens[counted] = self.served_tokens.get(counted, 0) + tokens

    # -- room freeing -----------------------------------------------------------------
    def freed(self, model: str) -> None:
        """Room may have freed for `model`'s requests: hand it to the best waiting ones allowed it (their tenant
        under its limit) while a replica has it."""
        state = self.models.get(model)
        if state is None or not len(state.queue) or self._freeing:
            return  # (a pick given back below frees nothing new)
        self._freeing = True
        try:
            self._hand_out(model, state)
        finally:
            self._freeing = False

    def _hand_out(self, model: str, state: _Model) -> None:
        queue, picker, shares = state.queue, self.picker, state.shares
        shares.rotate(self._clock())
        capacity = self._capacity(model)
        limit = shares.limits(capacity)

        def eligible(tenant: str, priority: int) -> bool:
            use = shares.tenants.get((tenant, priority))
            return use is not None and use.running < limit(use)

        while (entry := queue.peek(eligible)) is not None:
            future, request = entry.item
            endpoint = picker.pick(model, (), request.affinity, request.pools)
            if endpoint is None:
                return  # no replica left: the waiters time out, or the model comes back
            if self._full(endpoint):
                picker.release(endpoint, None, model)
                return
            queue.pop(eligible)
            picker.ledger.waiting(model, -1)  # counted by its pick from now on
            use = shares.tenants[entry.tenant, entry.priority]
            use.waiting -= 1
            _start(request, use)
            future.set_result(endpoint)
            limit = shares.limits(capacity)  # its start moved the sums

    def polled(self) -> None:
        """The engines' load was read again: those whose queues emptied have room."""
        for model, state in self.models.items():
            if len(state.queue):
                self.freed(model)

    # -- helpers ----------------------------------------------------------------------
    def _has_room(self, model: str, shares: ModelShares, use: Use) -> bool:
        """Whether a request of `use`'s tenant and class may start on `model`: the tenant runs fewer than its limit
        there (router.picking.shares)."""
        return use.running < shares.limit(use, self._capacity(model))

    def _capacity(self, model: str) -> int:
        """This router's share of what `model`'s replicas run at once (picker.routes has them)."""
        return sum(self._share(e) for e in self.picker.routes.by_model.get(model, ()))

    def _share(self, endpoint: Endpoint) -> int:
        """This router's share of `endpoint`'s capacity: each of the N routers reporting usage (as the hub last
        counted them, for keys' rate limits too) takes a 1/N share, rounded up; clients spread over the routers
        give each about 1/N of the requests."""
        routers = self.picker.ledger.limits.routers
        return -(-endpoint.capacity // routers) if routers > 1 else endpoint.capacity

    def _full(self, endpoint: Endpoint) -> bool:
        """Whether `endpoint`, just picked for a request, has no room for it beside this router's others: its share
        of the capacity, less what its engine said waits in its own queue (other routers' requests past their
        shares, or a capacity set above the engine's batch)."""
        if not endpoint.capacity:
            return False  # a replica of another profile, without a bound
        others = endpoint.outstanding - 1
        return others >= self._share(endpoint) - (endpoint.engine_waiting or 0)

    def _model(self, model: str) -> _Model:
        state = self.models[model] = _Model(
            FairQueue(max_waiting=self.max_waiting, max_wait_seconds=self.max_wait_seconds, clock=self._clock)
        )
        return state

    def _waited(self, model: str, entry: Waiting) -> float:
        waited = self._clock() - entry.arrived
        self.waits.observe((model, NAMES[entry.priority]), waited)
        return waited

    def _refuse(self, model: str, priority: int, why: str) -> None:
        counted = (model, NAMES[priority], why)
        self.refused[counted] = self.refused.get(counted, 0) + 1

    def waiting(self) -> dict[tuple[str, str], int]:
        """(model, class) -> requests waiting now."""
        found: dict[tuple[str, str], int] = {}
        for model, state in self.models.items():
            for priority, count in state.queue.by_class().items():
                found[model, NAMES[priority]] = count
        return found


def _start(request: Forwarding, use: Use) -> None:
    """Count `request` as running on its model, for its tenant and class."""
    use.running += 1
    use.saw()
    request.admitted = use


def _tenant(request: Forwarding) -> tuple[str, int]:
    """(the request's tenant, its weight): its key's team, or the key."""
    key = request.key
    return ("", 1) if key is None else (key.tenant, key.weight)


def _priority(request: Forwarding) -> int:
    return class_of(request.scope, request.key)


def class_of(scope: Scope, key: KeyInfo | None) -> int:
    """A request's class (hub.priority's rank): its key's, lowered (never raised) by its LLMGW-Priority header;
    a RouterError (400) naming the classes for a header that names none."""
    own = key.priority if key is not None else STANDARD
    for name, value in scope["headers"]:
        if name == PRIORITY_HEADER:
            asked = RANKS.get(value.decode("latin-1").strip().lower())
            if asked is None:
                raise RouterError(
                    400,
                    f"The LLMGW-Priority header must be one of {', '.join(RANKS)}, not {value.decode('latin-1')!r}.",
                    "invalid_priority",
                )
            return max(own, asked)
    return own


def queue_full(model: str, key: KeyInfo | None, full: QueueFull) -> RouterError:
    """429: the tenant already has its bound of requests waiting for `model` in this router."""
    whose = "this key" if key is None or key.team_id is None else f"team “{key.tenant}”"
    return RouterError(
        429,
        f"`{model}` is at capacity and {full.waiting} requests of {whose} already wait for it "
        f"(LLMGW_QUEUE_MAX_WAITING). Retry after {math.ceil(full.retry_after)} s.",
        "queue_full",
        headers=[(b"retry-after", str(math.ceil(full.retry_after)).encode())],
    )


def queue_timeout(model: str, waited: float) -> RouterError:
    """503: the request waited its bound in `model`'s queue without a replica having room."""
    return RouterError(
        503,
        f"`{model}` is at capacity: the request waited {waited:.1f} s in its queue (LLMGW_QUEUE_MAX_WAIT_SECONDS) "
        "without a replica having room. Retry later.",
        "queue_timeout",
        type_="server_error",
        headers=[(b"retry-after", b"1")],
    )


class AdmissionCollector(Collector):
    """The fair queues as Prometheus reads them: requests waiting and their waits by model and class, requests
    refused, and the tokens served to each team from the queue with its weight."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        admission = self.admission
        waiting = GaugeMetricFamily(
            "llmgw_router_queue_waiting",
            "Requests waiting in this router's fair queue for a full model, by class.",
            labels=["model", "class"],
        )
        for (model, name), count in sorted(admission.waiting().items()):
            waiting.add_metric([model, name], count)
        yield waiting
        yield admission.waits.family()
        refused = CounterMetricFamily(
            "llmgw_router_queue_refused",
            "Requests refused by a full model's fair queue: `full` (429, the tenant's bound of waiting requests) or "
            "`timeout` (503, waited its bound).",
            labels=["model", "class", "reason"],
        )
        for labels, count in sorted(admission.refused.copy().items()):
            refused.add_metric(list(labels), count)
        yield refused
        served = CounterMetricFamily(
            "llmgw_router_queue_served_tokens",
            "Tokens of answers that waited in a full model's fair queue, by team (keys of no team together): each "
            "team's share against its weight.",
            labels=["model", "team"],
        )
        for (model, team), tokens in sorted(admission.served_tokens.copy().items()):
            served.add_metric([model, team], tokens)
        yield served
        weight = GaugeMetricFamily(
            "llmgw_router_team_weight", "Each team's weight in full models' fair queues.", labels=["team"]
        )
        for team, value in sorted(admission.weights.copy().items()):
            weight.add_metric([team], value)
        yield weight
