"""`ctl_status`: the "What can I stop" section, --top/--all, a screenful at 1,000 nodes, and a closed pipe."""

import json
import os
import subprocess
import sys
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.utils import timezone

from dashboard.management.commands.ctl_status import some_names
from reconciler.choices import Hold, ReplicaState
from reconciler.models import Replica
from tests.fleet import bulk_fleet, make_model, make_node, make_replica, watch_usage

ROOT = Path(__file__).resolve().parents[3]
L40S = "L40S-48GB"


def run(*args) -> str:
    out = StringIO()
    call_command("ctl_status", *args, stdout=out)
    return out.getvalue()


def section(text: str, title: str) -> list[str]:
    """The lines of one section, up to the next blank line."""
    lines = text.splitlines()
    start = lines.index(title) + 1
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


@pytest.fixture
def idle_fleet(db):
    """Three stop candidates: two H100 replicas idle over an hour (12 GPUs), one L40S idle ten minutes."""
    watch_usage(known_since=timezone.now() - timedelta(days=1))
    a = make_node("gpu-a", fabric="ib-a")
    c = make_node("gpu-c", gpus=2, gpu_class=L40S)
    now = timezone.now()
    eight = make_model("llama-70b", gpus_per_node=8, min_replicas=0).profiles.get()
    four = make_model("qwen-32b", gpus_per_node=4, min_replicas=0).profiles.get()
    small = make_model("phi-4", gpus_per_node=2, min_replicas=0, gpu_class=L40S).profiles.get()
    b = make_node("gpu-b", fabric="ib-a")
    wide = make_replica(eight, placement=[(a, range(8))], last_used=now - timedelta(hours=3))
    half = make_replica(four, placement=[(b, range(4))], last_used=now - timedelta(hours=2))
    tiny = make_replica(small, placement=[(c, [0, 1])], last_used=now - timedelta(minutes=10))
    make_replica(four, state=ReplicaState.PENDING, error="needs 4×H100-80GB")
    return wide, half, tiny


def test_section_totals_idle_held_gpus_and_lists_the_best_candidates(idle_fleet):
    wide, half, tiny = idle_fleet
    lines = section(run(), "What can I stop")
    assert lines[0] == "  12 GPUs held by replicas idle over an hour (H100-80GB 12)"
    assert lines[1].split() == ["REPLICA", "MODEL", "GPUS", "NODES", "IDLE", "FREES", "UNBLOCKS"]
    assert lines[2].split()[:5] == [str(wide.pk), "llama-70b", "8", "gpu-a", "3h00m"]
    assert "a whole H100-80GB node on ib-a" in lines[2]
    assert lines[3].split()[:5] == [str(half.pk), "qwen-32b", "4", "gpu-b", "2h00m"]
    # The other 4 GPUs of gpu-b are free; the pending qwen-32b fits there already, so nothing is unblocked.
    assert "a whole H100-80GB node on ib-a" in lines[3] and lines[3].split()[-1] == "-"
    assert lines[4].split()[:2] == [str(tiny.pk), "phi-4"] and len(lines) == 5


def test_top_limits_the_table_and_says_how_many_more(idle_fleet):
    lines = section(run("--top", "1"), "What can I stop")
    assert len(lines) == 4 and lines[-1] == "  … and 2 more (--all)"
    assert len(section(run("--all"), "What can I stop")) == 5


def test_json_keeps_every_key_and_adds_what_can_i_stop(idle_fleet):
    printed = json.loads(run("--json", "--top", "1"))
    old = {"generated_at", "leader", "partition_brake", "capacity", "free_nodes", "nodes", "replicas", "models"}
    assert old | {"unplaceable", "replica_list", "usage", "idle_held_gpus", "stoppable"} | {
        "unplaceable_models",
        "failed",
        "node_list",
        "continuations",
        "felt",
        "staging",
    } == set(printed)
    assert [e["replica"] for e in printed["stoppable"]] == [r.pk for r in idle_fleet]  # --top is for text only


@pytest.mark.parametrize("value", ["0", "-3"])
def test_top_below_one_is_a_clear_error(db, value):
    with pytest.raises(CommandError, match=f"--top must be at least 1, got {value}"):
        run("--top", value)


def test_top_that_is_not_a_number_is_a_clear_error(db):
    with pytest.raises(CommandError, match="argument --top: invalid int value: 'ten'"):
        run("--top", "ten")


def test_unknown_usage_prints_why_and_that_stops_wait(idle_fleet):
    watch_usage(known_since=None, reason="usage collection failed this tick")
    lines = section(run(), "What can I stop")
    assert lines == [
        "  usage is unknown (usage collection failed this tick): nothing counts as idle, "
        "so idle stops and evictions wait until it is known again"
    ]


def test_replicas_are_counted_per_model_and_state_unless_all(idle_fleet):
    text = run()
    lines = section(text, "Models (--replicas lists every replica)")
    assert lines[0].split() == [
        "MODEL", "ENABLED", "WANTED", "GPUS", "PENDING", "STARTING", "READY", "SLEEPING", "WAKING", "STOPPING",
        "FAILED",
    ]  # fmt: skip
    # Models that need a look come first: qwen-32b wants 2 and has 1 ready.
    assert lines[1].split()[:3] + lines[1].split()[4:] == ["qwen-32b", "yes", "2", "1", "0", "1", "0", "0", "0", "0"]
    assert "Replica list" not in text
    assert len(section(run("--all"), "Replica list")) == 1 + 4


def test_some_names_shows_a_few_and_counts_the_rest():
    names = [f"gpu-{i:04d}" for i in range(1, 188)]
    assert some_names(names) == "gpu-0001, gpu-0002, gpu-0003 and 184 more"
    assert some_names(names[:3]) == "gpu-0001, gpu-0002, gpu-0003"
    assert some_names(names, None).count(",") == 186
    assert some_names([]) == "-"


def test_a_thousand_nodes_fit_on_a_screen_and_all_prints_everything(db):
    watch_usage(known_since=timezone.now() - timedelta(days=1))
    # 500 nodes full of idle replicas, 500 whole free; 500 models, as big catalogs have.
    bulk_fleet(1000, fabrics=4, models=500, replicas=2000)
    lines = run().splitlines()
    assert len(lines) < 60
    assert "  … and 492 more models (--models lists them all)" in lines
    assert len(section(run("--models"), "Models")) == 1 + 500
    assert not any("gpu-0999" in line or "gpu-1000" in line for line in lines)
    free = section("\n".join(lines), "Free whole nodes")
    assert free[1].split()[:3] == ["ib-0", "H100-80GB", "125"] and free[1].endswith("and 122 more")
    stop = section("\n".join(lines), "What can I stop")
    assert stop[0] == "  4000 GPUs held by replicas idle over an hour (H100-80GB 4000)"
    assert len(stop) == 2 + 10 + 1 and stop[-1] == "  … and 1990 more (--all)"
    everything = run("--all").splitlines()
    assert len(everything) > 2000 + 2000
    assert any("gpu-1000" in line for line in everything)


def _database_url() -> str:
    db = connection.settings_dict
    if db["ENGINE"] == "django.db.backends.sqlite3":
        return f"sqlite:///{db['NAME']}"
    return (
        f"postgres://{db['USER']}:{db['PASSWORD'] or ''}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    )


@pytest.mark.django_db(transaction=True)
def test_exits_quietly_when_the_output_pipe_closes_early():
    # Committed rows (transaction=True), so the subprocess reads this fleet from the test database.
    watch_usage(known_since=timezone.now() - timedelta(days=1))
    bulk_fleet(50, replicas=100)
    env = os.environ | {"DATABASE_URL": _database_url(), "SECRET_KEY": "test-only"}
    for args in ([], ["--all"], ["--json"]):
        process = subprocess.Popen(
            [sys.executable, "manage.py", "ctl_status", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        # Like `ctl_status | head -0`: the reader is gone before the first write (Django takes
        # longer than this to start), so every write the command makes meets a closed pipe.
        process.stdout.close()
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=60) == 0, stderr
        assert stderr == ""


@pytest.mark.django_db(transaction=True)
def test_head_reads_the_first_line_through_a_real_pipe():
    watch_usage(known_since=timezone.now() - timedelta(days=1))
    bulk_fleet(1000, replicas=2000)  # --all prints far more than a pipe buffer, so writes outlive `head`
    env = os.environ | {"DATABASE_URL": _database_url(), "SECRET_KEY": "test-only"}
    result = subprocess.run(
        f'{sys.executable} manage.py ctl_status --all | head -1; echo "status ${{PIPESTATUS[0]}}"',
        shell=True,
        executable="/bin/bash",
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.startswith("llmgw status at ")
    assert result.stdout.splitlines()[-1] == "status 0" and result.stderr == ""


def test_held_models_are_shown_apart_from_unplaceable_ones(db):
    waits = make_model("waits", gpus_per_node=8, min_replicas=0).profiles.get()
    stuck = make_model("stuck", gpus_per_node=8, min_replicas=0).profiles.get()
    make_replica(waits, state=ReplicaState.PENDING, error="making room: stopping replica 7")
    Replica.objects.filter(model__name="waits").update(hold=Hold.MAKING_ROOM)
    make_replica(stuck, state=ReplicaState.PENDING, error="no node has GPU class H100-80GB")

    text = run()

    assert section(text, "Unplaceable")[1].split()[:2] == ["stuck", "1"]
    held = section(text, "Held (room being made, nodes reporting in)")
    assert held[1].split()[:2] == ["waits", "1"] and len(held) == 2
    assert "waits" not in " ".join(section(text, "Unplaceable"))
