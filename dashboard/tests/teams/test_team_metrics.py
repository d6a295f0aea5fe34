"""The control plane's /metrics carries each team's spend in the UTC day and month, its own budgets' use and how
many budgets bearing on it are exhausted, labelled by team (and window) only, in the same number of queries for
3 teams as for 43; a budget's use it cannot read is left out, never reported as 0."""

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port
from hub import RedisHub

pytestmark = pytest.mark.django_db

TEAM_FAMILIES = {
    "llmgw_team_spend": {"team", "window"},
    "llmgw_team_budget_used_ratio": {"team", "window"},
    "llmgw_team_budgets_exhausted": {"team"},
    "llmgw_team_budgets_known": set(),
    "llmgw_team_gpu_hours": {"team"},
}


def team_samples(client) -> dict:
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        if family.name.startswith("llmgw_team"):
            for sample in family.samples:
                assert set(sample.labels) == TEAM_FAMILIES[family.name]  # no user, no key: bounded series
                samples[(sample.name, tuple(sorted(sample.labels.values())))] = sample.value
        elif family.name == "llmgw_summary_up":
            assert family.samples[0].value == 1
    return samples


def test_each_team_has_its_spend_budget_use_and_exhausted_budgets(client, used, budget_hub):
    assert team_samples(client) == {
        ("llmgw_team_spend", ("day", "ml")): 1.75,
        ("llmgw_team_spend", ("ml", "month")): 4.75,
        ("llmgw_team_spend", ("day", "search")): 0.000125,
        ("llmgw_team_spend", ("month", "search")): 0.000125,
        ("llmgw_team_spend", ("day", "idle")): 0.0,
        ("llmgw_team_spend", ("idle", "month")): 0.0,
        ("llmgw_team_budget_used_ratio", ("day", "ml")): 0.75,  # its own budgets only: not ada's, not bob's key's
        ("llmgw_team_budget_used_ratio", ("ml", "month")): 1.0,
        ("llmgw_team_budgets_exhausted", ("ml",)): 2,  # its month budget and ada's
        ("llmgw_team_budgets_exhausted", ("search",)): 0,
        ("llmgw_team_budgets_exhausted", ("idle",)): 0,
        ("llmgw_team_budgets_known", ()): 1,
        # The showback this month: an hour of one replica shared 3:1:1, an idle half hour of another.
        ("llmgw_team_gpu_hours", ("ml",)): 0.6,
        ("llmgw_team_gpu_hours", ("search",)): 0.2,
        ("llmgw_team_gpu_hours", ("idle",)): 0.0,
        ("llmgw_team_gpu_hours", ("(no team)",)): 0.2,
        ("llmgw_team_gpu_hours", ("(idle)",)): 0.5,
    }


def test_a_scrape_runs_the_same_queries_for_3_teams_and_for_43(
    client, used, budget_hub, more_teams, django_assert_num_queries
):
    with CaptureQueriesContext(connection) as few:
        team_samples(client)
    more_teams(40)
    with django_assert_num_queries(len(few.captured_queries)):
        samples = team_samples(client)
    assert samples[("llmgw_team_spend", ("day", "team-039"))] == 40
    assert samples[("llmgw_team_budget_used_ratio", ("day", "team-039"))] == 0
    assert sum(1 for name, _ in samples if name == "llmgw_team_budgets_exhausted") == 43


def test_budgets_the_hub_cannot_tell_are_left_out_and_said_unknown(client, teams, monkeypatch):
    monkeypatch.setattr("dashboard.metrics.get_hub", lambda: RedisHub(f"redis://127.0.0.1:{free_port()}/0"))
    samples = team_samples(client)
    assert samples[("llmgw_team_budgets_known", ())] == 0
    assert samples[("llmgw_team_spend", ("ml", "month"))] == 4.75  # spend comes from the database
    assert not [name for name, _ in samples if name in ("llmgw_team_budget_used_ratio", "llmgw_team_budgets_exhausted")]
