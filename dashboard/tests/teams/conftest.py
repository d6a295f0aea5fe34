"""Fixtures for the teams' surfaces: teams with members, keys, hourly spend and budgets at a fixed instant, and the
hub whose counters hold what each budget used (the process's own, or the real Redis)."""

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

import pytest
from django.contrib.auth.models import User

from hub import InProcessHub, get_hub, reset_hub
from hub.budgets import Limit, Reservation
from hub.redis_budgets import RedisBudgets
from keys.budget_use import current_use
from keys.models import ApiKey, Budget, GpuHour, ReplicaTokens, TokenUsage
from keys.showback import roll_up
from teams.models import Membership, Team

NOW = datetime(2026, 3, 14, 9, 30, tzinfo=UTC)
TODAY = datetime(2026, 3, 14, tzinfo=UTC)


@pytest.fixture(autouse=True)
def frozen(monkeypatch):
    """The team summary is made at NOW, so its day, month and budgets' windows are the same whenever it runs."""
    monkeypatch.setattr("dashboard.team_summary.timezone", SimpleNamespace(now=lambda: NOW))


@pytest.fixture(params=["in-process", "redis"])
def budget_hub(request, settings):
    """The process's hub, as the control plane's metrics read it: in-process (embedded), or Redis (distributed)."""
    if request.param == "redis":
        request.getfixturevalue("redis_settings")
    else:
        settings.REDIS_URL = None
    reset_hub()
    yield get_hub()
    reset_hub()


def hold(hub, budget: Budget, amount: str) -> None:
    """Hold `amount` in the budget's counter of its window at NOW (a reservation counts as spent until settled)."""
    units = int(Decimal(amount).scaleb(12))
    (use,) = current_use([budget], hub, NOW)
    counters = hub.budgets if isinstance(hub, InProcessHub) else RedisBudgets(hub._sync)
    assert counters.reserve(Reservation(f"r-{use.counter}", units, [Limit(use.counter, 10**20)], 3600, "d m")) is None


def spent(key: ApiKey, hour: datetime, amount: str, model: str = "llama") -> TokenUsage:
    """An hourly row of what `key` was charged on `model` (its team's, as routers store them)."""
    return TokenUsage.objects.create(
        key=key, key_name=key.name, model=model, hour=hour, requests=1, team=key.team, user=key.user,
        spend_units=int(Decimal(amount).scaleb(12)),
    )  # fmt: skip


def gpu_used(tokens: dict[ApiKey, int], hour: datetime, replica: int, gpu_seconds: float) -> None:
    """A replica's hour of GPU time, and the tokens it served each key then (keys.showback)."""
    GpuHour.objects.create(replica_id=replica, model="llama", hour=hour, gpu_seconds=gpu_seconds)
    ReplicaTokens.objects.bulk_create(
        ReplicaTokens(replica_id=replica, hour=hour, key=key, team=key.team, tokens=n) for key, n in tokens.items()
    )


@dataclass
class Teams:
    """What the `teams` fixture made."""

    ml: Team
    search: Team
    idle: Team
    day: Budget
    month: Budget
    member: Budget
    key: Budget


@pytest.fixture
def teams(db) -> Teams:
    """Three teams. “ml”: two members, two usable keys (and a revoked and an expired one), 1.75 spent today and
    4.75 this month (besides last month's and another team's rows), a day budget in Paris time and a month budget
    in UTC of its own, a member's budget and a key's. “search”: 0.000125 spent, no budget. “idle”: nothing. A
    replica's hour this morning shared 3:1:1 by ada's key, eve's and the key of no team, another's idle."""
    ml, search, idle = (Team.objects.create(name=name) for name in ("ml", "search", "idle"))
    ada, bob, eve = (User.objects.create_user(name) for name in ("ada", "bob", "eve"))
    Membership.objects.bulk_create(
        [Membership(team=ml, user=ada), Membership(team=ml, user=bob), Membership(team=search, user=eve)]
    )
    adas = ApiKey.issue("ada's", team=ml, user=ada)[0]
    bobs = ApiKey.issue("bob's", team=ml, user=bob)[0]
    ApiKey.issue("revoked", team=ml, user=ada, active=False)
    ApiKey.issue("expired", team=ml, user=bob, expires_at=NOW - timedelta(days=1))
    eves = ApiKey.issue("eve's", team=search, user=eve)[0]
    outside = ApiKey.issue("no team")[0]
    spent(adas, TODAY + timedelta(hours=9), "1.5")
    spent(bobs, TODAY, "0.25", model="qwen")
    spent(adas, datetime(2026, 3, 2, 17, tzinfo=UTC), "3")
    spent(adas, datetime(2026, 2, 28, 23, tzinfo=UTC), "100")  # last month
    spent(outside, TODAY, "50")  # no team's
    spent(eves, TODAY + timedelta(hours=8), "0.000125")
    gpu_used({adas: 300, eves: 100, outside: 100}, TODAY + timedelta(hours=8), replica=1, gpu_seconds=3600)
    gpu_used({}, TODAY + timedelta(hours=7), replica=2, gpu_seconds=1800)  # idle: served no tokens
    gpu_used({adas: 1}, datetime(2026, 2, 28, 23, tzinfo=UTC), replica=1, gpu_seconds=3600)  # last month
    while roll_up(NOW):  # the hours that ended are summed from their roll-up, as on a running fleet (keys.showback)
        pass
    return Teams(
        ml, search, idle,
        day=Budget.objects.create(team=ml, amount=Decimal(10), window="day", timezone="Europe/Paris"),
        month=Budget.objects.create(team=ml, amount=Decimal(4), window="month"),
        member=Budget.objects.create(team=ml, user=ada, amount=Decimal(1), window="day"),
        key=Budget.objects.create(key=bobs, amount=Decimal(5), window="week"),
    )  # fmt: skip


@pytest.fixture
def used(teams, budget_hub) -> Teams:
    """The teams' budgets in the hub: the day budget holds 7.50 of 10, the month budget all of its 4, ada's all of
    her 1 and bob's key 0.20 of 5: two of “ml”'s budgets are exhausted."""
    for budget, amount in ((teams.day, "7.5"), (teams.month, "4"), (teams.member, "1"), (teams.key, "0.2")):
        hold(budget_hub, budget, amount)
    return teams


@pytest.fixture
def more_teams(db):
    """Add `count` teams, each with a member, a key, spend today and a budget of its own."""

    def add(count: int) -> None:
        for index in range(count):
            team = Team.objects.create(name=f"team-{index:03}")
            user = User.objects.create_user(f"user-{index:03}")
            Membership.objects.create(team=team, user=user)
            key = ApiKey.issue(f"key-{index:03}", team=team, user=user)[0]
            spent(key, TODAY, str(index + 1))
            Budget.objects.create(team=team, amount=Decimal(100), window="day")

    return add
