"""Leadership under Celery (DESIGN invariant 1), with real `celery worker` and `celery beat` processes over
the real Redis broker and this test's database: steady whatever the number of workers, handed over at
once on a clean shutdown, within TTL + one interval when the leader is killed, untouched by a Redis
restart; and only one of several beats sends ticks.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from django.conf import settings
from django.db import connection

from conftest import free_port, wait_until
from reconciler.models import Lease
from reconciler.tasks import tick
from reconciler.tests.conftest import celery_broker

ROOT = Path(__file__).resolve().parents[3]
TICK = 0.3  # the processes' LLMGW_TICK_SECONDS


def test_database_url() -> str:
    """This test's database, as a DATABASE_URL for the processes it starts."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    credentials = quote(db["USER"] or "") + (f":{quote(db['PASSWORD'])}" if db["PASSWORD"] else "")
    return f"postgres://{credentials}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


test_database_url.__test__ = False  # a helper, not a test


class Process:
    """One Celery process started by a test; its output goes to a log file the test reads."""

    def __init__(self, name: str, argv: list[str], env: dict, log_dir: Path):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(argv, env=env, cwd=log_dir, stdout=log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def count(self, text: str) -> int:
        return self.log().count(text)

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def __repr__(self) -> str:
        return f"<{self.name} pid {self.popen.pid}>"


class Celery:
    """Starts `celery worker` and `celery beat` processes with the commands docs/running.md gives; kills them all at the end."""

    def __init__(self, log_dir: Path, redis_url: str, ttl: float, tick: float = TICK):
        self.log_dir = log_dir
        self.processes: list[Process] = []
        self.env = {
            **os.environ,
            "DATABASE_URL": test_database_url(),
            "SECRET_KEY": "test-only",
            "REDIS_URL": redis_url,
            "LLMGW_TICK_SECONDS": str(tick),
            "LLMGW_LEASE_TTL_SECONDS": str(ttl),
            "LLMGW_HOME": str(log_dir),
            "PYTHONPATH": str(ROOT),
            "LOG_LEVEL": "INFO",
        }

    def worker(self, name: str) -> Process:
        argv = [sys.executable, "-m", "celery", "-A", "llmgw_site", "worker", "-n", f"{name}@%h"]
        argv += ["--pool", "solo", "--loglevel", "INFO", "-Q", "celery", "--without-mingle", "--without-gossip"]
        return self._start(name, argv)

    def beat(self, name: str) -> Process:
        return self._start(name, [sys.executable, "-m", "celery", "-A", "llmgw_site", "beat", "--loglevel", "INFO"])

    def _start(self, name: str, argv: list[str]) -> Process:
        process = Process(name, argv, self.env, self.log_dir)
        self.processes.append(process)
        return process

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.log()[-3000:]}" for p in self.processes)

    def kill_all(self) -> None:
        for process in self.processes:
            if process.popen.poll() is None:
                process.popen.kill()
            process.popen.wait(10)


@pytest.fixture
def celery_at(transactional_db, tmp_path):
    """celery_at(redis_url, ttl, tick) → a process starter; every process is killed before the database is reset."""
    started = []

    def start(redis_url: str, ttl: float = 1.0, tick: float = TICK) -> Celery:
        started.append(Celery(tmp_path, redis_url, ttl, tick))
        return started[-1]

    yield start
    for celery in started:
        celery.kill_all()


def lease() -> Lease | None:
    return Lease.objects.filter(name=settings.LLMGW_LEASE_NAME).first()


def started_and_led(celery: Celery, workers: list[Process], timeout: float = 30) -> Process:
    """Wait until every worker is ready and one leads and consumes the leader queue; return the leader."""

    def ready():
        return all(w.count(" ready.") for w in workers) and lease() is not None

    wait_until(ready, timeout=timeout, interval=0.05, describe=celery.logs)
    owner = lease().owner
    leader = wait_until(
        lambda: next(
            (w for w in workers if owner in w.log() and w.count("Started consuming from reconcile-leader")), 0
        ),
        timeout=3,
        describe=celery.logs,
    )
    return leader


def received(worker: Process) -> int:
    """How many ticks the worker has received (Celery logs each at INFO)."""
    return sum(1 for line in worker.log().splitlines() if "reconciler.tasks.tick[" in line and "received" in line)


@pytest.mark.redis
def test_leadership_stays_with_one_worker_while_beat_ticks_and_several_run(celery_at, redis_url):
    # Were ticks taken by whichever worker is free, and the lease renewed only by ticks, each of
    # 3 workers would see one tick per 1.2 s and the 1 s lease would change hands.
    celery = celery_at(redis_url, ttl=1.0, tick=0.4)
    workers = [celery.worker(f"w{i}") for i in range(3)]
    celery.beat("beat")
    leader = started_and_led(celery, workers)
    first, before = lease(), received(leader)

    def eight_more_ticks_and_the_same_leader():
        row = lease()
        assert (row.owner, row.epoch) == (first.owner, first.epoch), celery.logs()
        return received(leader) >= before + 8

    wait_until(eight_more_ticks_and_the_same_leader, timeout=6, interval=0.05, describe=celery.logs)
    assert [received(w) for w in workers if w is not leader] == [0, 0]
    assert sum(w.count("lease reconciler: leader as") for w in workers) == 1


@pytest.mark.redis
def test_a_worker_shutting_down_releases_the_lease_and_a_standby_takes_over_at_once(celery_at, redis_broker):
    celery = celery_at(redis_broker, ttl=30.0)  # without the release, a takeover would wait 30 s
    workers = [celery.worker("w1"), celery.worker("w2")]
    leader = started_and_led(celery, workers)
    standby = next(w for w in workers if w is not leader)
    first = lease()

    leader.signal(signal.SIGTERM)  # warm shutdown
    leader.popen.wait(5)
    assert "released by" in leader.log()
    row = wait_until(lambda: (r := lease()).owner != first.owner and r, timeout=2, describe=celery.logs)
    assert row.epoch == first.epoch + 1
    assert row.owner in standby.log()
    wait_until(lambda: standby.count("Started consuming from reconcile-leader"), timeout=2, describe=celery.logs)
    tick.apply_async(expires=2)
    wait_until(lambda: received(standby) == 1, timeout=3, describe=celery.logs)


@pytest.mark.redis
def test_a_killed_leader_is_replaced_within_ttl_and_one_interval(celery_at, redis_broker):
    celery = celery_at(redis_broker, ttl=1.0)
    leader = started_and_led(celery, [celery.worker("w1")])
    # Started later, the standby campaigns out of step with the leader's renewals, as it would in a fleet.
    standby = celery.worker("w2")
    # A bound on a process starting (seconds when the suite's other passes load both cores), not on leadership.
    wait_until(lambda: standby.count(" ready."), timeout=30, describe=celery.logs)
    first = lease()

    leader.signal(signal.SIGKILL)
    killed = time.monotonic()
    leader.popen.wait(5)
    expired_at = lease().expires_at  # the dead leader renews no more
    row = wait_until(lambda: (r := lease()).owner != first.owner and r, timeout=3, interval=0.02)
    took = time.monotonic() - killed
    assert took <= 1.0 + TICK + 0.3, f"a new leader after {took:.2f} s"
    # By the database clock: the standby took the lease within one interval of its expiry.
    taken_at = row.expires_at - 1.0
    assert taken_at - expired_at <= TICK + 0.15, f"taken {taken_at - expired_at:.2f} s after it expired"
    assert row.epoch == first.epoch + 1


@pytest.mark.redis
def test_a_redis_restart_does_not_move_leadership(celery_at, tmp_path, settings):
    port = free_port()
    argv = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]

    def start_redis():
        server = subprocess.Popen([*argv, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
        client = redis.Redis(port=port)
        wait_until(lambda: _ping(client), timeout=3)
        return server

    server = start_redis()
    private_url = f"redis://127.0.0.1:{port}/0"
    try:
        with celery_broker(private_url):
            celery = celery_at(private_url, ttl=5.0)
            workers = [celery.worker("w1"), celery.worker("w2")]
            leader = started_and_led(celery, workers)
            first = lease()

            server.terminate()
            server.wait(5)
            server = start_redis()
            # Both workers notice and reconnect; the leader consumes the leader queue again.
            wait_until(
                lambda: all(w.count("Connected to redis://") >= 2 for w in workers), timeout=8, describe=celery.logs
            )
            tick.apply_async(expires=2)
            wait_until(lambda: received(leader) >= 1, timeout=3, describe=celery.logs)
            assert (lease().owner, lease().epoch) == (first.owner, first.epoch)
            assert sum(w.count("lease reconciler: leader as") for w in workers) == 1
    finally:
        server.kill()
        server.wait(5)


def _ping(client) -> bool:
    try:
        return client.ping()
    except redis.ConnectionError:
        return False


@pytest.mark.redis
def test_of_two_beats_only_the_one_holding_the_redis_lock_sends_ticks(celery_at, redis_url):
    celery = celery_at(redis_url, ttl=1.0)  # the beat lock lapses after ceil(max(TTL, 5 ticks)) = 2 s
    beats = [celery.beat("beat1"), celery.beat("beat2")]
    queue = redis.Redis.from_url(redis_url)

    def sent(beat):
        return beat.count("Sending due task reconcile-tick")

    wait_until(lambda: sum(map(sent, beats)) >= 6, timeout=20, describe=celery.logs)  # both beats started
    sender = next(b for b in beats if sent(b))
    other = next(b for b in beats if b is not sender)
    assert sent(other) == 0, celery.logs()
    # Beat logs a send before it publishes it: the queue holds every tick the lock holder logged, and only those,
    # once its latest publish has landed.
    wait_until(lambda: queue.llen(settings.LLMGW_LEADER_QUEUE) == sent(sender), timeout=2, describe=celery.logs)
    assert sent(other) == 0, celery.logs()

    sender.signal(signal.SIGKILL)  # its lock lapses; the other beat takes the schedule over
    sender.popen.wait(5)
    wait_until(lambda: sent(other) >= 2, timeout=4, describe=celery.logs)
    assert other.count("beat: Acquired lock") == 1


@pytest.mark.redis
def test_beat_keeps_sending_ticks_after_redis_comes_back_empty(celery_at, redis_url):
    """A Redis restarted without persistence has lost the schedule: beat installs it again."""
    celery = celery_at(redis_url, ttl=1.0)
    beat = celery.beat("beat")
    wait_until(lambda: beat.count("Sending due task reconcile-tick") >= 2, timeout=20, describe=celery.logs)

    redis.Redis.from_url(redis_url).flushdb()  # what a restart of a Redis that keeps nothing on disk leaves
    before = beat.count("Sending due task reconcile-tick")

    wait_until(lambda: beat.count("Sending due task reconcile-tick") >= before + 2, timeout=20, describe=celery.logs)
    assert beat.count("installing it again") >= 1
