"""The team summary: each team's members, usable keys, spend in the UTC day and month from the hourly rows, its own
budgets' use in their windows, how many budgets bearing on it are exhausted and its GPU-hours this month, in seven
queries and one hub round trip whatever the number of teams and rows; a budget's use is unknown, never zero, when the hub cannot tell it."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from conftest import free_port
from dashboard.team_summary import TeamBudgetStatus, team_summary
from dashboard.tests.teams.conftest import TODAY
from hub import RedisHub
from keys.budget_use import money
from keys.models import ApiKey, TokenUsage

pytestmark = pytest.mark.django_db

UNITS = 10**12


def test_each_team_has_its_members_usable_keys_spend_and_own_budgets(used, budget_hub, django_assert_num_queries):
    # The teams (counted), their spend (summed), the budgets bearing on them, the month's showback (four: where the
    # roll-up ends, the sums of the hours rolled up, the division of the others and their idle time).
    with django_assert_num_queries(7):
        summary = team_summary(budget_hub)
    assert summary.budgets_known
    assert (summary.day_start, summary.month_start) == ("2026-03-14T00:00:00+00:00", "2026-03-01T00:00:00+00:00")
    assert [team.name for team in summary.teams] == ["ml", "search", "idle"]  # the most spent this month first
    ml, search, idle = summary.teams
    assert (ml.members, ml.active_keys) == (2, 2)  # neither the revoked key nor the expired one
    assert (ml.spend_today_units, ml.spend_month_units) == (1_750_000_000_000, 4_750_000_000_000)
    assert ml.budgets == [  # its own only, by window; resets at the next local midnight (Paris: 23:00 UTC)
        TeamBudgetStatus("day", "Europe/Paris", 10 * UNITS, 7_500_000_000_000, "2026-03-14T23:00:00+00:00"),
        TeamBudgetStatus("month", "UTC", 4 * UNITS, 4 * UNITS, "2026-04-01T00:00:00+00:00"),
    ]
    assert [budget.used_ratio for budget in ml.budgets] == [0.75, 1.0]
    assert ml.budgets_exhausted == 2  # its month budget and ada's; not its day budget nor bob's key's
    assert (search.members, search.active_keys, search.spend_today_units, search.spend_month_units) == (
        1, 1, 125_000_000, 125_000_000,
    )  # fmt: skip
    assert (search.budgets, search.budgets_exhausted) == ([], 0)
    assert (idle.members, idle.active_keys, idle.spend_month_units, idle.budgets_exhausted) == (0, 0, 0, 0)
    # This month's showback: the shared hour 3:1:1, the idle one nobody's; last month's hour left out.
    assert (ml.gpu_seconds_month, search.gpu_seconds_month, idle.gpu_seconds_month) == (2160.0, 720.0, 0.0)
    assert (summary.gpu_seconds_month_no_team, summary.gpu_seconds_month_idle) == (720.0, 1800.0)


def test_the_queries_are_the_same_for_3_teams_and_for_43(used, budget_hub, more_teams, django_assert_num_queries):
    with django_assert_num_queries(7):
        assert len(team_summary(budget_hub).teams) == 3
    more_teams(40)
    with django_assert_num_queries(7):
        summary = team_summary(budget_hub)
    assert len(summary.teams) == 43
    assert summary.teams[0].name == "team-039" and summary.teams[0].spend_today_units == 40 * UNITS


def test_without_a_hub_the_budgets_use_is_unknown_not_zero(teams):
    summary = team_summary(None)
    assert not summary.budgets_known
    ml = summary.teams[0]
    assert [(budget.window, budget.used_units, budget.used_ratio) for budget in ml.budgets] == [
        ("day", None, None),
        ("month", None, None),
    ]
    assert ml.budgets_exhausted is None
    assert ml.budgets[0].text() == "- / 10.00 per day, resets 2026-03-15 00:00 CET"
    assert ml.spend_month_units == 4_750_000_000_000  # the spend is known all the same


def test_a_hub_that_does_not_answer_leaves_the_use_unknown(teams):
    summary = team_summary(RedisHub(f"redis://127.0.0.1:{free_port()}/0"))
    assert not summary.budgets_known and summary.teams[0].budgets_exhausted is None
    assert summary.teams[0].budgets[1].used_units is None and summary.teams[0].spend_today_units == 1_750_000_000_000


def test_a_budget_reads_as_used_over_amount_per_window_with_its_local_reset():
    day = TeamBudgetStatus("day", "Europe/Paris", 10 * UNITS, 7_500_000_000_000, "2026-03-14T23:00:00+00:00")
    assert day.text() == "7.50 / 10.00 per day, resets 2026-03-15 00:00 CET"
    week = TeamBudgetStatus("week", "America/New_York", 50 * UNITS, 0, "2026-03-16T04:00:00+00:00")
    assert week.text() == "0.00 / 50.00 per week, resets 2026-03-16 00:00 EDT"
    assert TeamBudgetStatus("none", "UTC", 3 * UNITS, UNITS, None).text() == "1.00 / 3.00 for all time"


def test_a_budget_of_nothing_is_wholly_used():
    assert TeamBudgetStatus("day", "UTC", 0, 0, None).used_ratio == 1.0
    assert TeamBudgetStatus("day", "UTC", 0, 5, None).used_ratio == float("inf")


@pytest.mark.parametrize(
    ("units", "text"),
    [
        (0, "0.00"),
        (1_500_000_000_000, "1.50"),
        (3 * UNITS, "3.00"),
        (125_000_000, "0.000125"),
        (12_345_678_901_234_567, "12345.678901"),
        (500_000, "0.000001"),  # half a millionth rounds up
        (499_999, "<0.000001"),  # spent, but less than text shows: never "0.00"
        (1, "<0.000001"),
    ],
)
def test_money_shows_six_decimals_at_most_trimmed_to_two(units, text):
    assert money(units) == text


@pytest.mark.postgres_only
def test_the_spend_query_reads_the_team_hour_index(teams):
    """Over a long history, the month's rows of each team are one range of the (team, hour) index, not every row of
    the team filtered by hour."""
    key = ApiKey.objects.get(name="ada's")
    history = [TODAY - timedelta(hours=hours) for hours in range(1, 24 * 200)]
    TokenUsage.objects.bulk_create(
        TokenUsage(key=key, key_name=key.name, model="old", hour=hour, team=key.team, spend_units=1) for hour in history
    )
    with CaptureQueriesContext(connection) as queries:
        team_summary(None)
    (spend,) = [query["sql"] for query in queries.captured_queries if "keys_tokenusage" in query["sql"]]
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE keys_tokenusage")
        cursor.execute("SET LOCAL enable_seqscan = off")  # a small table: a scan of it all would cost as little
        cursor.execute(f"EXPLAIN {spend}")
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "token_usage_team_hour" in plan, plan
