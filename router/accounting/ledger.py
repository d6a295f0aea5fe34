"""The router's ledger of use: last-use stamps, requests in flight and their peaks, tokens per key, rate limits,
broken answers per model.

Everything a request leaves behind that the control plane reads later goes
here, and the usage flusher (router.accounting.flusher) takes it all in one
step. The picker writes a replica's stamp in the same step of the event loop
as it chooses that replica (DESIGN invariant 4), so recording use costs a
dict write per request and nothing else; counting the model's requests in
flight and their peak (for scale-out on load) is two more dict updates in
that step. A LoRA adapter picked on a replica stamps `"<replica>/<adapter>"`
too, and counts in flight under the base, whose scale-out carries its
adapters' load, and under the adapter, which the leader spreads over more
replicas when busy. Only the router's event loop writes it: no lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hub.contracts import ADAPTER_STAMP_SEPARATOR, RequestRecord
from router.accounting.continuations import ContinuationCounter
from router.accounting.counter import TokenCounter
from router.accounting.limits import RateLimiter
from router.endpoints.routes import RouteTable
from router.endpoints.table import Endpoint

MAX_RECORDS = 100_000  # per-request records a router keeps while its flushes fail


class Ledger:
    """What requests leave behind until the next flush: stamps, in-flight counts and peaks, tokens, rate limits,
    broken answers.

    `clock` (wall time) stamps last use and tells the rate limits' minute.
    """

    def __init__(self, routes: RouteTable, clock: Callable[[], float] = time.time, records: bool = False) -> None:
        self._routes = routes
        self._clock = clock
        self._stamps: dict[str, float] = {}  # replica id (or "<replica>/<adapter>") -> last use, not yet flushed
        self._adapter_busy: dict[str, int] = {}  # "<replica>/<adapter>" -> its requests in flight (none: left out)
        self._in_flight: dict[str, int] = {}  # public name -> requests picked and not yet released
        self._peaks: dict[str, int] = {}  # public name -> most in flight at once since the last take
        # Requests and tokens per key and model: the proxy counts into it when an answer ends.
        self.tokens = TokenCounter(clock)
        # Limited keys' allowances: the app admits from them, the proxy adds tokens, the flusher syncs them.
        self.limits = RateLimiter(clock)
        # Answers whose engine broke off: the proxy and the resumer count into it beside their metric.
        self.continuations = ContinuationCounter()
        # Each request, where routers keep a per-request log (LLMGW_REQUEST_RECORD_DAYS); None: they do not.
        self.records: list[RequestRecord] | None = [] if records else None

    def picked(self, endpoint: Endpoint, model: str) -> None:
        """`endpoint` was chosen for a request of `model` (a model, or an adapter riding on `endpoint.model`)."""
        now = self._clock()
        self._stamps[endpoint.replica_id] = now
        base = endpoint.model
        if base != model:
            key = endpoint.replica_id + ADAPTER_STAMP_SEPARATOR + model
            self._stamps[key] = now
            self._adapter_busy[key] = self._adapter_busy.get(key, 0) + 1
            self._count_in_flight(model)
        self._count_in_flight(base)

    def _count_in_flight(self, name: str) -> None:
        in_flight = self._in_flight.get(name, 0) + 1
        self._in_flight[name] = in_flight
        if in_flight > self._peaks.get(name, 0):
            self._peaks[name] = in_flight

    def waiting(self, model: str, change: int) -> None:
        """A request of `model` began (+1) or ended (-1) waiting in its fair queue (router.forwarding.admission): it
        counts as in flight meanwhile, so a model whose requests wait for room shows the demand that scales it out.
        An adapter's counts for its base too, as its picks do."""
        base = self._routes.base_of(model)
        for name in (model,) if base is None else (model, base):
            if change > 0:
                self._count_in_flight(name)
            else:
                self._in_flight[name] -= 1

    def released(self, endpoint: Endpoint, model: str | None) -> None:
        """The request `picked` counted is over; `model` as picked (needed when that is an adapter's)."""
        try:  # noqa: SIM105 (contextlib.suppress costs a context manager per request)
            self._in_flight[endpoint.model] -= 1
        except KeyError:  # a release without its pick: nothing was counted
            pass
        if model is not None and model != endpoint.model:
            self._in_flight[model] -= 1
            key = endpoint.replica_id + ADAPTER_STAMP_SEPARATOR + model
            left = self._adapter_busy.get(key, 0) - 1
            if left > 0:
                self._adapter_busy[key] = left
            else:
                self._adapter_busy.pop(key, None)

    def take_usage(self) -> tuple[dict[str, float], dict[str, int]]:
        """Swap out the stamps and the per-model in-flight peaks gathered since the last take.

        A replica serving a request right now is stamped "now" as well (and so is
        an adapter on a replica serving it), so a long stream keeps its replica
        and adapter in use and the idle timeout cannot stop it mid-answer. The next peak window starts at what is
        in flight now, so a long request still counts in every window it spans. The cost grows with
        replicas, models and adapters, not with traffic.
        """
        stamps, self._stamps = self._stamps, {}
        peaks = self._peaks
        self._peaks = {model: count for model, count in self._in_flight.items() if count}
        busy = [e.replica_id for e in self._routes.by_replica.values() if e.outstanding > 0]
        busy.extend(self._adapter_busy)
        if busy:
            now = self._clock()
            for replica_id in busy:
                stamps[replica_id] = now
        return stamps, peaks

    def take_records(self) -> list[RequestRecord]:
        """Swap out the per-request records gathered since the last take (none when not kept)."""
        records = self.records
        if not records:
            return []
        taken = records[:]
        records.clear()  # the same list: the app holds it
        return taken

    def restore_records(self, records: list[RequestRecord]) -> None:
        """Put back records a flush could not deliver, oldest first; past MAX_RECORDS the oldest are dropped."""
        if self.records is not None and records:
            self.records[:0] = records
            del self.records[:-MAX_RECORDS]

    def restore_stamps(self, stamps: dict[str, float]) -> None:
        """Put back stamps a flush could not deliver; a newer stamp for the same replica wins."""
        for replica_id, ts in stamps.items():
            if ts > self._stamps.get(replica_id, float("-inf")):
                self._stamps[replica_id] = ts

    def waiting_stamps(self) -> dict[str, float]:
        """The stamps not yet flushed (a copy), to look at without taking them."""
        return dict(self._stamps)

    def in_flight(self) -> int:
        """Requests picked and not yet released, over every replica."""
        return sum(e.outstanding for e in self._routes.by_replica.values())
