"""`manage.py ctl_status --teams`: a section of every team (the most spent this month first, ten unless --all) with
its members, usable keys, spend today and this month and its own budgets as used / amount per window with their
local reset; the same queries for 3 teams as for 43; nothing changes without it."""

import json
import re
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.test.utils import CaptureQueriesContext

from dashboard.team_summary import team_summary

pytestmark = pytest.mark.django_db

TITLE = "Teams (spend today and this month, UTC)"
redis_only = pytest.mark.parametrize("budget_hub", ["redis"], indirect=True)  # ctl_status reads counters in Redis


def run(*args) -> str:
    out = StringIO()
    call_command("ctl_status", *args, stdout=out)
    return out.getvalue()


def section(text: str) -> list[list[str]]:
    """The Teams section's lines after its title, each split into its cells (two spaces or more apart)."""
    lines = text.splitlines()
    start = lines.index(TITLE) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start:end]]


@redis_only
def test_each_team_shows_members_keys_spend_and_its_budgets_use_and_reset(used, budget_hub):
    assert section(run("--teams")) == [
        ["TEAM", "MEMBERS", "KEYS", "TODAY", "THIS MONTH", "GPU-H", "BUDGET"],
        ["ml", "2", "2", "1.75", "4.75", "0.6",
         "7.50 / 10.00 per day, resets 2026-03-15 00:00 CET; 4.00 / 4.00 per month, resets 2026-04-01 00:00 UTC"],
        ["search", "1", "1", "0.000125", "0.000125", "0.2", "no budget"],
        ["idle", "0", "0", "0.00", "0.00", "0.0", "no budget"],
        ["GPU-hours this month besides teams: 0.2 keys of no team, 0.5 idle (`manage.py showback` for any month)"],
    ]  # fmt: skip


@redis_only
def test_ten_teams_are_shown_and_the_rest_counted_unless_all(used, budget_hub, more_teams):
    more_teams(12)
    rows = section(run("--teams"))
    # The header, 10 teams, the rest, the GPU time of no team's.
    assert len(rows) == 13 and rows[-2] == ["… and 5 more teams (--all)"]
    spending = [f"team-{index:03}" for index in range(11, 3, -1)]  # 12.00 down to 5.00, then ml's 4.75
    assert [row[0] for row in rows[1:11]] == [*spending, "ml", "team-003"]
    every = section(run("--teams", "--all"))
    assert len(every) == 17 and every[-2][0] == "idle"


@redis_only
def test_the_queries_are_the_same_for_3_teams_and_for_43(used, budget_hub, more_teams, django_assert_num_queries):
    with CaptureQueriesContext(connection) as without:
        run()
    with CaptureQueriesContext(connection) as few:
        run("--teams")
    assert len(few.captured_queries) == len(without.captured_queries) + 7  # dashboard.team_summary
    more_teams(40)
    with django_assert_num_queries(len(few.captured_queries)):
        assert "… and 33 more teams (--all)" in run("--teams")


def test_in_embedded_mode_the_budgets_use_is_unknown_here(teams, settings):
    settings.REDIS_URL = None  # the counters are in the `llmgw up` process's memory, not this one's
    text = run("--teams")
    ml = section(text)[1]
    assert ml[:6] == ["ml", "2", "2", "1.75", "4.75", "0.6"]
    assert ml[6].startswith("- / 10.00 per day, resets 2026-03-15 00:00 CET; - / 4.00 per month")
    assert "budgets' use is unknown (-): in embedded mode the counters are in the `llmgw up` process" in text


@redis_only
def test_json_carries_the_team_summary_only_with_teams(used, budget_hub):
    printed = json.loads(run("--json", "--teams"))
    assert printed["team_summary"] == team_summary(budget_hub).as_json()
    assert printed["team_summary"]["teams"][0]["budgets"][0]["used_units"] == 7_500_000_000_000
    assert "team_summary" not in json.loads(run("--json"))


def test_without_teams_nothing_changes(teams):
    text = run("--all")
    assert TITLE not in text and "ml" not in text.split()


def test_check_and_teams_do_not_go_together():
    with pytest.raises(CommandError, match="--check and --teams do not go together"):
        run("--check", "--teams")


def test_teams_beside_a_full_list_lists_every_team(teams, more_teams):
    more_teams(12)
    text = run("--nodes", "--teams")
    assert text.splitlines()[1] == "Node list"
    rows = section(text)
    assert len(rows) == 18 and rows[-3][0] == "idle" and rows[-1][0].startswith("budgets' use is unknown")
