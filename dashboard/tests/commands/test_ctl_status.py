"""`manage.py ctl_status`: JSON for scripts, aligned tables for people, both from the one summary."""

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import call_command
from django.utils import timezone

from dashboard.management.commands.ctl_status import usage_bar
from dashboard.summary import cluster_summary
from dashboard.summary_types import Capacity
from inventory.choices import NodeState
from reconciler.choices import ReplicaState
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet():
    a = make_node("gpu-a", gpus=8, fabric="ib-a")
    make_node("gpu-b", gpus=8, fabric="ib-a")
    make_node("gpu-c", gpus=8, fabric="ib-b", state=NodeState.UNREACHABLE)
    profile = make_model("llama-70b", gpus_per_node=4, min_replicas=0).profiles.get()
    big = make_model("big-405b", gpus_per_node=8, nodes_per_replica=2, min_replicas=0).profiles.get()
    known = make_replica(
        profile, placement=[(a, [0, 1, 2, 3])], last_used=timezone.now() - timedelta(seconds=192), endpoint="http://a:1"
    )
    unknown = make_replica(profile, state=ReplicaState.STARTING, placement=[(a, [4, 5, 6, 7])], endpoint="http://a:2")
    make_replica(big, state=ReplicaState.PENDING, error="needs 2 whole H100-80GB nodes on one fabric; free: 1 on ib-a")
    return known, unknown


def run(*args) -> str:
    out = StringIO()
    call_command("ctl_status", *args, stdout=out)
    return out.getvalue()


def test_json_output_is_the_cluster_summary(fleet):
    printed = json.loads(run("--json"))
    expected = cluster_summary().as_json()
    for key in ("capacity", "free_nodes", "nodes", "replicas", "models", "unplaceable"):
        assert printed[key] == expected[key]
    assert [r["id"] for r in printed["replica_list"]] == [r["id"] for r in expected["replica_list"]]
    assert printed["capacity"][0]["used"] == 8 and printed["capacity"][0]["unavailable"] == 8


def test_text_shows_capacity_bar_and_counts_per_gpu_class(fleet):
    text = run()
    assert "H100-80GB  [#####xxxxx------]  8/24 used  8 free  0 unhealthy  8 unavailable" in text


def test_text_lists_free_whole_nodes_per_fabric_and_unplaceable_reasons(fleet):
    lines = run().splitlines()
    assert any(line.split() == ["ib-a", "H100-80GB", "1", "gpu-b"] for line in lines)
    assert any("big-405b" in line and "needs 2 whole H100-80GB nodes on one fabric" in line for line in lines)


def test_text_shows_idle_time_and_a_dash_when_unknown(fleet):
    known, unknown = fleet
    rows = {line.split()[0]: line.split() for line in run("--all").splitlines() if line.strip()}
    assert rows[str(known.pk)][-1] == "3m12s"
    assert rows[str(unknown.pk)][-1] == "-"
    assert rows[str(unknown.pk)][1:5] == ["llama-70b", "starting", "gpu-a", "4"]


def test_text_columns_are_aligned(fleet):
    lines = run("--all").splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["ID", "MODEL"])
    idle_column = lines[header].index("IDLE")
    for line in lines[header + 1 : header + 3]:
        assert line[idle_column - 2 : idle_column] == "  " and line[idle_column] != " "


def test_empty_cluster_prints_without_error():
    text = run()
    assert "no GPUs reported" in text and "leader: none" in text


def test_usage_bar_marks_used_unhealthy_and_unavailable():
    row = Capacity(gpu_class="H100-80GB", total=16, used=4, free=8, unhealthy=2, unavailable=2)
    assert usage_bar(row) == "[####!!xx--------]"


def test_an_unmigrated_database_gets_a_clear_error_not_a_traceback(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "SECRET_KEY")} | {
        "LLMGW_HOME": str(tmp_path)
    }
    result = subprocess.run(
        [sys.executable, "manage.py", "ctl_status"], cwd=root, env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1
    assert "has `manage.py migrate` run?" in result.stderr
    assert "Traceback" not in result.stderr
