"""Budgets as reservations (hub.budgets, hub.redis_budgets): windows start at local midnights, daylight saving
included; a request is taken from every budget at once or from none; two routers reserving at once never overrun
a budget, and once every answer is settled the counters equal the ledger exactly; a reservation never settled
is charged at what it reserved, to the counters and the ledger alike."""

import random
import threading
import uuid
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
import redis

from hub.budgets import InProcessBudgets, Limit, Refusal, Reservation, Window, counter_name, window
from hub.redis_budgets import TOKENS_KEY, RedisBudgets, used_of

PARIS, SANTIAGO = ZoneInfo("Europe/Paris"), ZoneInfo("America/Santiago")


def at(zone, *parts) -> datetime:
    """A local wall-clock time as an instant."""
    return datetime(*parts[:6], tzinfo=zone) + timedelta(microseconds=parts[6] if len(parts) > 6 else 0)


def utc(*parts) -> datetime:
    return datetime(*parts, tzinfo=UTC)


@pytest.mark.parametrize(
    ("zone", "now", "start", "end"),
    [
        # A tenth of a second before midnight, and midnight itself: the next day's window.
        ("Europe/Paris", at(PARIS, 2026, 12, 4, 23, 59, 59, 900_000), utc(2026, 12, 3, 23), utc(2026, 12, 4, 23)),
        ("Europe/Paris", at(PARIS, 2026, 12, 5, 0, 0, 0), utc(2026, 12, 4, 23), utc(2026, 12, 5, 23)),
        # Clocks forward at 02:00: a day of 23 hours. Back at 03:00: 25 hours.
        ("Europe/Paris", at(PARIS, 2026, 3, 29, 12, 0, 0), utc(2026, 3, 28, 23), utc(2026, 3, 29, 22)),
        ("Europe/Paris", at(PARIS, 2026, 10, 25, 23, 59, 59, 900_000), utc(2026, 10, 24, 22), utc(2026, 10, 25, 23)),
        # Santiago skips its midnight of 6 September (00:00 -04 is 01:00 -03): the day begins at 01:00.
        ("America/Santiago", utc(2026, 9, 6, 3, 59, 59, 900_000), utc(2026, 9, 5, 4), utc(2026, 9, 6, 4)),
        ("America/Santiago", utc(2026, 9, 6, 4), utc(2026, 9, 6, 4), utc(2026, 9, 7, 3)),
        # and lives the hour from 23:00 to midnight of 4 April twice: that day has 25 hours.
        ("America/Santiago", at(SANTIAGO, 2026, 4, 4, 12, 0, 0), utc(2026, 4, 4, 3), utc(2026, 4, 5, 4)),
    ],
)
def test_a_days_window_runs_from_one_local_midnight_to_the_next(zone, now, start, end):
    assert window(Window.DAY, zone, now) == (start, end)


def test_weeks_start_on_monday_months_on_the_first_and_no_window_is_none():
    thursday = at(PARIS, 2026, 12, 31, 23, 59, 59, 900_000)
    assert window(Window.WEEK, "Europe/Paris", thursday) == (utc(2026, 12, 27, 23), utc(2027, 1, 3, 23))
    assert window(Window.MONTH, "Europe/Paris", thursday) == (utc(2026, 11, 30, 23), utc(2026, 12, 31, 23))
    new_year = at(PARIS, 2027, 1, 1, 0, 0, 0)
    assert window(Window.MONTH, "Europe/Paris", new_year) == (utc(2026, 12, 31, 23), utc(2027, 1, 31, 23))
    assert window(Window.NONE, "Europe/Paris", new_year) == (None, None)
    assert counter_name(7, None) == "7:all" and counter_name(7, utc(2026, 1, 1)) == "7:1767225600"


HOUR = 1_798_000_000 // 3600 * 3600
LEDGER = "digest-1 mock small"  # a model's name may hold spaces


class Ledger:
    """The ledger a hub keeps beside the counters: spend and requests per (hour, "<digest> <model>")."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, str], list[int]] = {}
        self.lock = threading.Lock()

    def charge(self, hour: int, ledger: str, spend: int, requests: int) -> None:
        with self.lock:
            row = self.rows.setdefault((hour, ledger), [0, 0])
            row[0] += spend
            row[1] += requests

    def spend(self) -> int:
        return sum(row[0] for row in self.rows.values())


class Side:
    """One router's view of the budgets: steps, a counter's use, and the ledger as the hub holds it."""

    def __init__(self, budgets, read_ledger):
        self.budgets, self.read_ledger = budgets, read_ledger

    def reserve(self, rid, amount, limits, ttl=30.0):
        return self.budgets.reserve(Reservation(rid, amount, limits, ttl, LEDGER))

    def settle(self, rid, cost):
        return self.budgets.settle(rid, cost, HOUR)

    def used(self, counter):
        return self.budgets.used(counter)


@pytest.fixture(params=["in-process", "redis"])
def budgets(request):
    """Both kinds, each as a factory of routers sharing one set of counters and one ledger: (spend, requests)."""
    if request.param == "in-process":
        ledger = Ledger()
        shared = InProcessBudgets(charge=ledger.charge)

        def totals():
            return ledger.spend(), sum(row[1] for row in ledger.rows.values())

        return lambda: Side(shared, totals)
    url = request.getfixturevalue("redis_url")
    client = redis.Redis.from_url(url)

    def totals():
        fields = {k.decode(): int(v) for k, v in client.hgetall(TOKENS_KEY).items()}
        spend = sum(v for k, v in fields.items() if k.startswith("spend "))
        return spend, sum(v for k, v in fields.items() if k.startswith("requests "))

    return lambda: Side(RedisBudgets(redis.Redis.from_url(url)), totals)


def test_a_request_is_taken_from_every_budget_or_from_none_and_its_cost_goes_to_the_ledger(budgets):
    side = budgets()
    key, team = Limit("1:0", 1_000, keep=60), Limit("2:0", 500)
    assert side.reserve("a", 400, [key, team]) is None
    # The team has 100 left: refused, and the key's budget is not touched either.
    assert side.reserve("b", 200, [key, team]) == Refusal("2:0", 400, 500)
    assert (side.used("1:0"), side.used("2:0")) == (400, 400)
    assert side.read_ledger() == (0, 0)  # a reservation is no spend yet
    assert side.settle("a", 150) is True  # the answer cost less than its worst case: the rest goes back
    assert (side.used("1:0"), side.used("2:0")) == (150, 150)
    assert side.read_ledger() == (150, 0)  # the router counts the request itself, with its tokens
    assert side.settle("a", 150) is False  # settled once only
    assert side.reserve("b", 350, [key, team]) is None
    assert side.settle("b", 400) is True  # beyond its worst case (a prompt longer than its bytes told): charged
    assert (side.used("1:0"), side.used("2:0"), side.read_ledger()) == (550, 550, (550, 0))


def test_amounts_past_what_a_double_holds_are_counted_exactly(budgets):
    """Spend units are 10^-12 of the currency: a budget of 50,000 is 5·10^16 of them, past 2^53."""
    side = budgets()
    limit = Limit("4:0", 50_000 * 10**12)
    worst = 12_345 * 10**12 + 987_654_321_123
    assert side.reserve("big", worst, [limit]) is None
    assert side.used("4:0") == worst
    assert side.settle("big", worst - 1) is True
    assert side.used("4:0") == worst - 1 and side.read_ledger() == (worst - 1, 0)
    assert side.reserve("over", limit.limit - worst + 2, [limit]) == Refusal("4:0", worst - 1, limit.limit)
    assert side.reserve("fits", limit.limit - worst + 1, [limit]) is None
    assert side.used("4:0") == limit.limit


def test_a_reservation_never_settled_expires_charged_at_what_it_reserved(budgets):
    side = budgets()
    if isinstance(side.budgets, InProcessBudgets):
        now, ledger = [0.0], Ledger()
        side = Side(InProcessBudgets(charge=ledger.charge, clock=lambda: now[0]), lambda: (ledger.spend(), 1))
        side.reserve("lost", 300, [Limit("3:0", 1_000)], ttl=0.05)
        now[0] = 1.0
        side.budgets.sweep()
    else:
        side.reserve("lost", 300, [Limit("3:0", 1_000)], ttl=0.05)
        threading.Event().wait(0.2)
        assert side.budgets.sweep() == 1
    assert side.settle("lost", 10) is False
    assert side.used("3:0") == 300
    assert side.read_ledger() == (300, 1)  # a request, charged its worst case


def test_two_routers_reserving_at_once_never_overrun_and_the_counters_equal_the_ledger(budgets):
    """500 requests of random worst cases against a budget for about 300 of them, from two routers in threads;
    each admitted answer settles a random real cost up to its worst case, some none (a client that left)."""
    rng = random.Random(7)
    requests = [(uuid.uuid4().hex, rng.randint(50, 150), rng.random()) for _ in range(500)]
    limit = Limit("9:0", 30_000)
    routers = [budgets(), budgets()]
    admitted: list[tuple[str, int, float]] = []
    peaks: list[int] = []
    lock = threading.Lock()

    def serve(router, share) -> None:
        for reservation, worst, part in share:
            if router.reserve(reservation, worst, [limit], ttl=60) is None:
                with lock:
                    admitted.append((reservation, worst, part))
                    peaks.append(router.used(limit.counter))

    threads = [threading.Thread(target=serve, args=(r, requests[i::2])) for i, r in enumerate(routers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert max(peaks) <= limit.limit  # never beyond it, at any moment seen
    assert 200 <= len(admitted) < 500
    costs = {reservation: int(worst * part) for reservation, worst, part in admitted}
    for reservation, cost in costs.items():
        assert routers[hash(reservation) % 2].settle(reservation, cost)
    assert routers[0].used(limit.counter) == sum(costs.values()) == routers[1].read_ledger()[0]


def test_counter_parts_read_back_as_spend_units():
    assert used_of([b"12", b"345"]) == 12_000_345 and used_of([None, None]) == 0


def test_an_embedded_process_forgets_a_windows_counter_once_it_is_kept_no_longer():
    """As Redis EXPIREs a window's counter `keep` seconds after its last use, the in-process counters forget it
    at the sweep after that; a budget with no window (keep 0) is kept for ever."""
    now = [0.0]
    counters = InProcessBudgets(clock=lambda: now[0])
    assert (
        counters.reserve(Reservation("r1", 5, [Limit("day:1", 100, keep=10), Limit("all", 100)], 3600, "d m")) is None
    )
    assert counters.settle("r1", 5, 0)
    now[0] = 9.0
    counters.sweep()
    assert (counters.used("day:1"), counters.used("all")) == (5, 5)
    now[0] = 10.0
    counters.sweep()
    assert (counters.used("day:1"), counters.used("all")) == (0, 5)
    assert counters._kept == {} and set(counters._used) == {"all"}
