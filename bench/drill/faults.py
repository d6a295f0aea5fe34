"""Each fault of the drill: inject it into the running stack, measure, restore, and judge.

A fault returns a `Row`: what was done, what must hold, the client errors
among the requests it could affect, the recovery time, and a verdict. The
three invariants (no GPU held twice, no profile above max, no orphan engine)
are checked after every fault.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
from django.db import connection

from catalog.choices import Engine
from catalog.models import Model, Profile
from drill.checks import engine_ports, invariants
from drill.load import Load
from drill.monitor import LeaseMonitor
from drill.stack import Proc, Stack, wait_for
from drill.streams import run_streams
from inventory.choices import NodeState
from inventory.models import Node
from reconciler.choices import ReplicaState
from reconciler.models import BusyPort, Replica, Shard


@dataclass
class Row:
    """One line of the drill's table."""

    fault: str
    must_hold: str
    errors: int | None = None
    requests: int | None = None
    recovery: str = "-"
    held: bool = False
    note: str = ""
    double: int = 0
    above_max: int = 0
    orphans: int = 0
    reconciling: bool = True  # a new model still placed and ready after the fault

    @property
    def verdict(self) -> str:
        clean = self.double == 0 and self.above_max == 0 and self.orphans == 0
        return "pass" if self.held and clean and self.reconciling else "FAIL"


def _db(fn):
    """Read the rows, reconnecting once if a fault broke the drill's own connection."""
    try:
        return fn()
    except Exception:
        connection.close()
        return fn()


class Faults:
    """The faults, run against one stack under one load."""

    def __init__(self, stack: Stack, load: Load, monitor: LeaseMonitor, tick: float, ttl: float, lost: float):
        self.stack, self.load, self.monitor = stack, load, monitor
        self.tick, self.ttl, self.lost = tick, ttl, lost

    # -- helpers ------------------------------------------------------------------------------
    def _reconciling(self) -> float | None:
        """Seconds for a new model to be placed and become ready (None: not within 30 s): the control
        plane still reconciles after the fault."""
        name = f"drill-probe-{int(time.monotonic() * 1000)}"
        model = _db(lambda: Model.objects.create(name=name, source="drill/probe"))
        _db(lambda: Profile.objects.create(model=model, engine=Engine.MOCK, gpu_class="H100-80GB", min_replicas=1))
        try:
            return wait_for(
                lambda: _db(lambda: Replica.objects.filter(model=model, state=ReplicaState.READY).exists()),
                30, 0.1, "the probe model ready",
            )  # fmt: skip
        except TimeoutError:
            return None
        finally:
            _db(lambda: Model.objects.filter(pk=model.pk).delete())

    def _finish(self, row: Row, since: float) -> Row:
        probe = self._reconciling()
        if probe is None:
            row.reconciling = False
            row.note = (row.note + "; " if row.note else "") + "NOT reconciling afterwards"
        counts = invariants(self.stack.workdir / "var")
        row.double, row.above_max, row.orphans = counts["double"], counts["above_max"], counts["orphans"]
        if row.requests is None:
            window = self.load.window(since, time.monotonic())
            row.requests, row.errors = len(window), sum(1 for r in window if r.status != 200)
            failed = [r for r in window if r.status != 200]
            if failed:
                print(f"   errors: {Counter(r.status for r in failed)}; first: {failed[0]}", flush=True)
        return row

    def _settle(self, timeout: float = 60) -> None:
        """Wait until every wanted replica is ready and every node is heard from."""

        def settled():
            replicas = list(Replica.objects.values_list("state", flat=True))
            nodes = set(Node.objects.values_list("state", flat=True))
            return replicas and all(s == ReplicaState.READY for s in replicas) and nodes == {NodeState.READY}

        wait_for(lambda: _db(settled), timeout, 0.25, "every replica ready and every node heard from")

    def _leader_worker(self) -> Proc:
        """The worker process holding the lease (it logged the owner id when it took it)."""
        owner = self.monitor.owner
        assert owner is not None, "nobody holds the lease"
        for worker in self.stack.workers:
            if worker.alive() and owner[0] in worker.text():
                return worker
        raise RuntimeError(f"no running worker logged lease owner {owner[0]}")

    def _restart(self, proc: Proc) -> None:
        proc.kill()
        proc.start()

    # -- faults -------------------------------------------------------------------------------
    def agent_kill(self) -> Row:
        row = Row(
            "SIGKILL an agent (engines die with it)", "no new request fails after 1 s; replaced within lost + start"
        )
        shard = _db(lambda: Shard.objects.select_related("node").order_by("pk").first())
        node = shard.node.name
        agent = self.stack.agents[node]
        killed_at = time.monotonic()
        agent.signal(signal.SIGKILL)

        def replaced():
            ready = Replica.objects.filter(state=ReplicaState.READY)
            wanted = Replica.objects.count()
            elsewhere = ready.exclude(shards__node__name=node).count()
            return elsewhere == wanted

        recovery = wait_for(lambda: _db(replaced), self.lost + 60, 0.2, "replicas serving elsewhere")
        time.sleep(5)  # held requests are answered, the load goes on
        if os.environ.get("DRILL_DEBUG"):
            for r in self.load.window(killed_at - 2, time.monotonic()):
                print(
                    f"   {r.sent - killed_at:+.2f} {r.done - r.sent:.2f}s {r.model} {r.status} {r.replica}", flush=True
                )
        late = self.load.window(killed_at + 1.0, time.monotonic())
        row.requests, row.errors = len(late), sum(1 for r in late if r.status != 200)
        failed = [r for r in late if r.status != 200]
        if failed:
            print(f"   errors after 1 s: {Counter(r.status for r in failed)}; first: {failed[0]}", flush=True)
        in_flight = self.load.window(killed_at - 60, killed_at + 1.0)
        early = [r for r in in_flight if r.status != 200]
        if early:
            print(f"   errors in the first second: {Counter(r.status for r in early)}; first: {early[0]}", flush=True)
        row.recovery = f"{recovery:.1f} s"
        row.note = f"{sum(1 for r in in_flight if r.status != 200)} error(s) in the first second"
        row.held = row.errors == 0 and recovery <= self.lost + 30
        agent.start()
        self._settle()
        return self._finish(row, killed_at)

    def leader_worker_kill(self) -> Row:
        row = Row("SIGKILL the leader's worker", f"new owner <= TTL + interval ({self.ttl + self.tick:g} s)")
        worker = self._leader_worker()
        killed_at = time.monotonic()
        worker.signal(signal.SIGKILL)
        took = wait_for(lambda: self.monitor.first_change_after(killed_at) is not None, self.ttl * 4, 0.1, "new owner")
        took = self.monitor.first_change_after(killed_at) - killed_at
        row.recovery = f"{took:.1f} s"
        row.held = took <= self.ttl + self.tick + 0.5  # + the monitor's sampling interval
        worker.start()
        return self._finish(row, killed_at)

    def leader_pause_in_tick(self) -> Row:
        row = Row(
            "SIGSTOP the leader inside its tick for 2xTTL",
            "standby leads <= TTL + interval; the paused tick commits nothing",
        )
        worker = self._leader_worker()

        def in_transaction():
            with connection.cursor() as cursor:
                # Between two statements of the tick's transaction; the lease's own statements are
                # single autocommitted ones, never idle inside a transaction.
                cursor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s AND state = 'idle in transaction'",
                    [worker.name],
                )
                return cursor.fetchone()[0] > 0

        wait_for(lambda: _db(in_transaction), 30, 0.002, "the leader inside a tick transaction")
        worker.signal(signal.SIGSTOP)
        paused_at = time.monotonic()
        log_before = len(worker.text())
        wait_for(lambda: self.monitor.first_change_after(paused_at) is not None, self.ttl * 3, 0.1, "a new owner")
        took = self.monitor.first_change_after(paused_at) - paused_at
        time.sleep(max(0.0, paused_at + 2 * self.ttl - time.monotonic()))
        worker.signal(signal.SIGCONT)
        time.sleep(self.tick * 3)
        after = worker.text()[log_before:]
        # Either the fence at commit refused the stale epoch, or the server had already cut the idle
        # transaction (idle_in_transaction_session_timeout) and rolled it back: nothing committed.
        fenced = "nothing committed" in after
        cut = "server closed the connection" in after or "terminating connection" in after
        committed_nothing = fenced or cut
        row.recovery = f"{took:.1f} s"
        row.note = (
            "fence refused the paused tick" if fenced else "server cut the paused transaction" if cut else
            "neither a refused fence nor a cut transaction logged after SIGCONT"
        )  # fmt: skip
        row.held = took <= self.ttl + self.tick + 0.5 and committed_nothing
        return self._finish(row, paused_at)

    def steady(self, workers: int, seconds: float) -> Row:
        row = Row(f"{seconds:g} s steady, {workers} worker(s)", "0 leadership changes")
        while len([w for w in self.stack.workers if w.alive()]) > workers:
            next(w for w in reversed(self.stack.workers) if w.alive()).stop(10)
        for index in range(len(self.stack.workers), workers):
            self.stack.workers.append(self.stack.worker(index + 1).start())
        for worker in self.stack.workers[:workers]:
            if not worker.alive():
                worker.start()
        time.sleep(self.ttl)  # let started or stopped workers settle before counting
        started = time.monotonic()
        time.sleep(seconds)
        changes = self.monitor.changes_between(started, time.monotonic())
        row.recovery = "-"
        row.note = f"{changes} leadership change(s)"
        row.held = changes == 0
        return self._finish(row, started)

    def redis_restart(self) -> Row:
        row = Row("Redis restart", "0 client errors, 0 leadership changes")
        redis = self.stack.redis
        started = time.monotonic()
        redis.proc.kill()
        redis.start()
        time.sleep(10)
        changes = self.monitor.changes_between(started, time.monotonic())
        row.note = f"{changes} leadership change(s)"
        self._finish(row, started)
        row.held = row.errors == 0 and changes == 0
        return row

    def postgres_stop(self, seconds: float) -> Row:
        row = Row(f"PostgreSQL stopped {seconds:g} s", "0 client errors (keys used before)")
        started = time.monotonic()
        self.stack.pg.stop()
        time.sleep(seconds)
        self.stack.pg.start()
        connection.close()
        time.sleep(10)
        self._finish(row, started)
        row.held = row.errors == 0
        return row

    def control_plane_kill(self) -> Row:
        row = Row("SIGKILL a control plane holding all agent streams", "agents commandable via the other <= 2 s")
        first, second = self.stack.control_planes
        # All streams on the first: restart the second so no agent is connected to it.
        self._restart(second)
        wait_for(lambda: all(self._connected_to(a, first) for a in self.stack.agents.values()), 30, 0.1,
                 "every agent on the first control plane")  # fmt: skip
        marks = {name: len(second.text()) for name in self.stack.agents}
        killed_at = time.monotonic()
        first.signal(signal.SIGKILL)
        took = wait_for(
            lambda: all(f"agent connected: {name}" in second.text()[marks[name]:] for name in self.stack.agents),
            30, 0.05, "every agent on the second control plane",
        )  # fmt: skip
        row.recovery = f"{took:.1f} s"
        row.held = took <= 2.0
        first.start()
        return self._finish(row, killed_at)

    def _connected_to(self, agent: Proc, cp: Proc) -> bool:
        port = self.stack.ports[cp.name]
        lines = [line for line in agent.text().splitlines() if " connected to ws://" in line]
        return bool(lines) and f":{port}/" in lines[-1]

    def control_plane_term(self) -> Row:
        row = Row("SIGTERM a control plane", "exits <= 5 s")
        cp = self.stack.control_planes[1]
        started = time.monotonic()
        took = cp.stop(timeout=15)
        row.recovery = f"{took:.1f} s" if took is not None else "killed after 15 s"
        row.held = took is not None and took <= 5.0
        cp.start()
        return self._finish(row, started)

    def port_busy(self) -> Row:
        row = Row("a port busy on a node", "<= 1 failed start")
        used = set(_db(lambda: list(Shard.objects.values_list("port", flat=True))))
        low, _ = 20000, 0
        port = next(p for p in range(low, low + 1000) if p not in used)
        blocker = socket.socket()
        blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            blocker.bind(("0.0.0.0", port))
            blocker.listen()
        except OSError:  # another process on this machine holds it already: busy all the same, which is the fault
            blocker.close()
        started = time.monotonic()
        try:
            model = _db(lambda: Model.objects.create(name="drill-port", source="drill/port"))
            _db(lambda: Profile.objects.create(model=model, engine=Engine.MOCK, gpu_class="H100-80GB", min_replicas=1))
            took = wait_for(
                lambda: _db(lambda: Replica.objects.filter(model=model, state=ReplicaState.READY).exists()),
                60, 0.2, "the new model ready",
            )  # fmt: skip
            failures = sum(cp.text().count(f"port {port} is busy") for cp in self.stack.control_planes)
            row.recovery = f"{took:.1f} s"
            row.note = f"{failures} failed start(s) on port {port}; busy mark: {_db(BusyPort.objects.count)}"
            row.held = failures <= 1
            _db(lambda: Model.objects.filter(pk=model.pk).delete())
        finally:
            blocker.close()
        return self._finish(row, started)

    def engine_kill_mid_stream(self, count: int = 16, max_tokens: int = 150) -> Row:
        """`count` streams of a two-replica model (greedy mock, 20 ms a token, so each lasts about 3 s) run once
        uninterrupted, then again with one replica's engine SIGKILLed a second in: every stream must end whole
        with the same text, continued on the other replica."""
        row = Row("SIGKILL an engine mid-stream", "0 client-visible errors; each stream as uninterrupted")
        model = _db(lambda: Model.objects.create(name="drill-stream", source="drill/stream"))
        _db(lambda: Profile.objects.create(
            model=model, engine=Engine.MOCK, gpu_class="H100-80GB", min_replicas=2, max_replicas=2,
            engine_args=["--greedy", "--token-delay-ms", "20"],
        ))  # fmt: skip
        ready = Replica.objects.filter(model=model, state=ReplicaState.READY)
        wait_for(lambda: _db(ready.count) == 2, 60, 0.2, "both replicas of drill-stream ready")
        routers, key = self.load.routers, self.load.key
        time.sleep(3)  # both routers have polled the table that publishes them
        before = self._continued(routers)
        reference = run_streams(routers, model.name, key, count, max_tokens)
        port = _db(lambda: Shard.objects.filter(replica__model=model).order_by("pk").values_list("port", flat=True)[0])
        pid = engine_ports(self.stack.workdir / "var")[port]
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(run_streams, routers, model.name, key, count, max_tokens)
            time.sleep(1.0)
            killed_at = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            results = running.result(timeout=120)
        continued = self._continued(routers) - before
        wrong = [i for i, (got, want) in enumerate(zip(results, reference, strict=True))
                 if not (got.whole and want.whole and got.text == want.text)]  # fmt: skip
        for i in wrong[:3]:
            print(f"   stream {i}: {results[i]} (uninterrupted: {reference[i].text[:60]!r}...)", flush=True)
        row.requests, row.errors = count, len(wrong)
        row.recovery = f"longest pause {max(r.longest_gap for r in results):.2f} s"
        row.note = f"{continued:g} continued on the other replica"
        row.held = not wrong and continued > 0 and all(r.whole for r in reference)
        _db(lambda: Model.objects.filter(pk=model.pk).delete())
        return self._finish(row, killed_at)

    @staticmethod
    def _continued(routers: list[str]) -> float:
        """Streams continued so far, by every router."""
        pattern = re.compile(r'^llmgw_router_stream_continuations_total\{[^}]*outcome="continued"[^}]*\} (\S+)$', re.M)
        return sum(float(v) for url in routers for v in pattern.findall(httpx.get(f"{url}/metrics", timeout=5).text))
