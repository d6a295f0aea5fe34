"""Showback: each replica's GPU time of an hour is divided between teams by their share of the tokens it served
in that hour; an hour with no tokens is idle time of its model; nothing is lost or counted twice."""

from datetime import UTC, datetime, timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from keys.models import ApiKey, GpuHour, ReplicaTokens, TeamGpuHour
from keys.showback import add_gpu_time, roll_up, rolled_until, showback
from keys.usage import store_tokens
from teams.models import Team

pytestmark = pytest.mark.django_db

H0 = 1_800_000_000  # an hour's start
H1 = H0 + 3600
START, END = datetime.fromtimestamp(H0, tz=UTC), datetime.fromtimestamp(H1 + 3600, tz=UTC)


@pytest.fixture
def keys():
    """Digests of three keys: of team search, of team ads, of no team."""
    search, ads = Team.objects.create(name="search"), Team.objects.create(name="ads")
    issued = [ApiKey.issue("s", team=search)[0], ApiKey.issue("a", team=ads)[0], ApiKey.issue("none")[0]]
    return [ApiKey.objects.get(pk=key.pk).key_hash for key in issued]


def test_a_replicas_hour_is_shared_by_tokens_and_an_hour_without_tokens_is_idle(keys):
    search, ads, nobody = keys
    add_gpu_time([(1, "llama", H0, 3600.0), (2, "qwen", H0, 7200.0), (3, "qwen", H0, 1800.0), (1, "llama", H1, 900.0)])
    store_tokens({}, {}, {H0: {"1": {search: 300, ads: 100}, "2": {nobody: 50}}, H1: {"1": {ads: 7}}})
    report = showback(START, END)
    shares = {(row.team, row.model): (row.gpu_seconds, row.tokens) for row in report.rows}
    assert shares == {
        ("search", "llama"): (2700.0, 300),
        ("ads", "llama"): (900.0 + 900.0, 107),
        (None, "qwen"): (7200.0, 50),
    }
    assert report.idle == {"qwen": 1800.0}  # replica 3 served nobody in its hour
    assert report.total_seconds == 3600 + 7200 + 1800 + 900  # every GPU second, once
    assert report.by_team() == {None: 7200.0, "search": 2700.0, "ads": 1800.0}


def test_the_window_bounds_the_hours_and_teams_bound_the_rows(keys):
    search, ads, _ = keys
    add_gpu_time([(1, "llama", H0, 100.0), (1, "llama", H1, 200.0)])
    store_tokens({}, {}, {H0: {"1": {search: 1}}, H1: {"1": {ads: 1}}})
    first_hour = showback(START, datetime.fromtimestamp(H1, tz=UTC))
    assert [(row.team, row.gpu_seconds) for row in first_hour.rows] == [("search", 100.0)]
    ads_team = Team.objects.get(name="ads").pk
    assert [(row.team, row.gpu_seconds) for row in showback(START, END, teams=[ads_team]).rows] == [("ads", 200.0)]
    assert showback(START, END, teams=[]).rows == []
    assert showback(START, END, teams=[ads_team]).idle == {}  # idle time is nobody's: operators only


def test_gpu_time_and_shares_add_up_across_stores(keys):
    search, ads, _ = keys
    add_gpu_time([(1, "llama", H0, 10.0)])
    add_gpu_time([(1, "llama", H0, 20.0)])
    store_tokens({}, {}, {H0: {"1": {search: 1}}})
    store_tokens({}, {}, {H0: {"1": {search: 2, ads: 3}}})
    assert GpuHour.objects.get().gpu_seconds == 30.0
    assert sorted(ReplicaTokens.objects.values_list("team__name", "tokens")) == [("ads", 3), ("search", 3)]
    assert {row.team: row.gpu_seconds for row in showback(START, END).rows} == {"search": 15.0, "ads": 15.0}


def test_shares_keep_the_keys_team_then_and_drop_unknown_keys_and_router_only_endpoints(keys):
    search, _, _ = keys
    store_tokens({}, {}, {H0: {"1": {search: 5, "no-such-key": 9}, "static-endpoint": {search: 4}}})
    ApiKey.objects.filter(key_hash=search).update(team=None)  # moved later: its earlier share stays with search
    assert list(ReplicaTokens.objects.values_list("replica_id", "team__name", "tokens")) == [(1, "search", 5)]


def run(*args) -> str:
    out = StringIO()
    call_command("showback", *args, stdout=out)
    return out.getvalue()


def test_the_command_prints_a_months_teams_models_and_idle_time_as_a_table_or_csv(keys):
    search, ads, nobody = keys
    add_gpu_time([(1, "llama", H0, 3600.0), (2, "qwen", H0, 1800.0)])
    store_tokens({}, {}, {H0: {"1": {search: 3, ads: 1}}})
    month = f"{START:%Y-%m}"
    assert run("--month", month).splitlines() == [
        f"Showback {month} (UTC): 1.5 GPU-hours",
        "  search         0.8   50.0%",
        "  ads            0.2   16.7%",
        "  (idle)         0.5   33.3%",
    ]
    assert "  ads     llama         0.2   16.7%" in run("--month", month, "--by-model").splitlines()
    assert run("--month", month, "--csv").splitlines() == [
        "team,model,gpu_hours,tokens",
        "ads,llama,0.250000,1",
        "search,llama,0.750000,3",
        "(idle),qwen,0.500000,0",
    ]
    assert run("--month", "2020-01").splitlines()[1] == "  no GPU time counted in this month"


def test_a_bad_month_is_refused_naming_the_form():
    with pytest.raises(
        CommandError, match=r"--month must be YYYY-MM from 2000-01 to 2999-12, as 2026-11: got '11/2026'"
    ):
        run("--month", "11/2026")


def test_rolling_hours_up_changes_no_figure_and_rolls_each_hour_once(keys, django_assert_num_queries):
    search, ads, nobody = keys
    add_gpu_time([(1, "llama", H0, 3600.0), (2, "qwen", H0, 1800.0), (1, "llama", H1, 900.0)])
    store_tokens({}, {}, {H0: {"1": {search: 300, ads: 100}}, H1: {"1": {ads: 7, nobody: 7}}})
    before = showback(START, END)
    ten_past = datetime.fromtimestamp(H1 + 600, tz=UTC)  # H0 ended ten minutes ago; H1 is still running
    assert roll_up(ten_past - timedelta(seconds=1)) == 0  # not yet
    assert roll_up(ten_past) == 3  # search's and ads' llama, qwen's idle time
    assert roll_up(ten_past) == 0 and rolled_until() == datetime.fromtimestamp(H1, tz=UTC)
    with django_assert_num_queries(4):  # where the roll-up ends, its sums, the division of the hour after
        after = showback(START, END)
    assert (after.rows, after.idle) == (before.rows, before.idle)
    ads_team = Team.objects.get(name="ads").pk
    assert [(row.team, row.gpu_seconds) for row in showback(START, END, teams=[ads_team]).rows] == [
        ("ads", 900.0 + 450.0)
    ]
    assert roll_up(datetime.fromtimestamp(H1 + 3600 + 600, tz=UTC)) == 2  # H1: ads' and no team's
    assert (showback(START, END).rows, showback(START, END).idle) == (before.rows, before.idle)


def test_a_roll_up_catches_up_a_day_at_a_time_over_days_without_gpu_time(keys):
    search, _, _ = keys
    later = H0 + 3 * 86400
    add_gpu_time([(1, "llama", H0, 60.0), (1, "llama", later, 30.0)])
    store_tokens({}, {}, {H0: {"1": {search: 1}}, later: {"1": {search: 1}}})
    week_after = datetime.fromtimestamp(H0 + 7 * 86400, tz=UTC)
    assert roll_up(week_after) == 1 and rolled_until() == datetime.fromtimestamp(H1, tz=UTC)  # H0's day only
    assert roll_up(week_after) == 1 and rolled_until() == datetime.fromtimestamp(
        later + 3600, tz=UTC
    )  # the gap skipped
    assert roll_up(week_after) == 0
    assert sorted(TeamGpuHour.objects.values_list("gpu_seconds", flat=True)) == [30.0, 60.0]
