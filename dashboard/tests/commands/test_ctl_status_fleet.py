"""`ctl_status` at fleet scale: --nodes, --replicas, failures grouped by reason, --check and --watch."""

import os
import signal
import subprocess
import sys
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from dashboard.management.commands.ctl_status import CHECK_FAILED, Command
from dashboard.summary import cluster_summary, first_line
from inventory.choices import GPUHealth, NodeState
from inventory.models import Node
from keys.models import ContinuationHour
from reconciler.choices import Hold, ReplicaState
from reconciler.models import Lease, ModelLoad, Replica
from teams.models import Team
from tests.fleet import bulk_fleet, make_model, make_node, make_replica, set_gpu, watch_usage

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[3]


def run(*args) -> str:
    out = StringIO()
    call_command("ctl_status", *args, stdout=out)
    return out.getvalue()


def check() -> tuple[int, str]:
    """(exit status, printed line) of `ctl_status --check`."""
    out = StringIO()
    try:
        call_command("ctl_status", "--check", stdout=out)
    except SystemExit as exc:
        return int(exc.code or 0), out.getvalue()
    return 0, out.getvalue()


@pytest.fixture
def healthy(settings):
    """A fleet with nothing to look at: a leader with a live lease, known usage, all GPUs healthy."""
    now = timezone.now()
    Lease.objects.create(name=settings.LLMGW_LEASE_NAME, owner="cp-1", epoch=3, expires_at=now.timestamp() + 60)
    watch_usage(known_since=now - timedelta(hours=2))
    node = make_node("gpu-a", gpus=4, fabric="ib-a")
    profile = make_model("llama", gpus_per_node=2, min_replicas=0).profiles.get()
    make_replica(profile, placement=[(node, [0, 1])], last_used=now)
    return node, profile


def failed(profile, error: str) -> Replica:
    replica = make_replica(profile, state=ReplicaState.FAILED)
    Replica.objects.filter(pk=replica.pk).update(last_error=error)
    return replica


def test_first_line_skips_blank_lines_and_names_a_missing_error():
    assert first_line("\n  CUDA out of memory  \nTraceback ...") == "CUDA out of memory"
    assert first_line("") == "(no error recorded)"


def test_failed_replicas_are_grouped_by_the_first_line_of_their_error_most_frequent_first(healthy):
    _node, profile = healthy
    other = make_model("qwen", gpus_per_node=2, min_replicas=0).profiles.get()
    failed(profile, "CUDA out of memory\ntraceback line")
    failed(other, "CUDA out of memory\nanother traceback")
    failed(profile, "engine exited with status 1")
    assert cluster_summary().as_json()["failed"] == [
        {"reason": "CUDA out of memory", "replicas": 2, "models": ["llama", "qwen"]},
        {"reason": "engine exited with status 1", "replicas": 1, "models": ["llama"]},
    ]
    lines = run().splitlines()
    assert any(line.split()[:3] == ["2", "llama,", "qwen"] and "CUDA out of memory" in line for line in lines)
    assert not any("traceback" in line for line in lines)


def test_nodes_prints_only_the_node_list_with_gpus_by_state(healthy):
    make_node("gpu-b", gpus=4, fabric="ib-b", state=NodeState.UNREACHABLE)
    lines = run("--nodes").splitlines()
    rows = {line.split()[0]: line.split() for line in lines if line.strip().startswith("gpu-")}
    assert rows["gpu-a"][1:8] == ["ib-a", "ready", "4", "2", "2", "0", "0"]
    assert rows["gpu-b"][1:8] == ["ib-b", "unreachable", "4", "0", "0", "0", "4"]
    assert not any("GPU capacity" in line or "Replica list" in line for line in lines)


def test_replicas_prints_only_the_replica_list(healthy):
    lines = run("--replicas").splitlines()
    assert any("Replica list" in line for line in lines)
    assert any(line.split()[1:4] == ["llama", "ready", "gpu-a"] for line in lines if line.strip())
    assert not any("GPU capacity" in line or "Node list" in line for line in lines)


def test_check_says_ok_and_exits_0_when_nothing_needs_attention(healthy):
    status, line = check()
    assert status == 0
    assert line == "ok: 1 nodes ready, 2/4 GPUs used, 1 replicas ready, leader cp-1 epoch 3\n"


@pytest.mark.parametrize(
    "break_it, phrase",
    [
        (lambda s, node, profile: Lease.objects.all().delete(), "no leader"),
        (
            lambda s, node, profile: Lease.objects.update(expires_at=timezone.now().timestamp() - 30),
            "leader lease expired 30s ago",
        ),
        (lambda s, node, profile: set_gpu(node, 3, health=GPUHealth.UNHEALTHY), "1 unhealthy GPUs"),
        (lambda s, node, profile: failed(profile, "boom"), "1 failed replicas"),
        (
            lambda s, node, profile: make_node("gpu-z", gpus=1, state=NodeState.UNREACHABLE),
            "1 unreachable nodes",
        ),
        (
            lambda s, node, profile: make_replica(profile, state=ReplicaState.PENDING, error="no room for 2 GPUs"),
            "1 unplaceable models (llama)",
        ),
        (lambda s, node, profile: watch_usage(reason="the watch lapsed"), "usage unknown (the watch lapsed)"),
    ],
)
def test_check_exits_2_naming_each_problem(healthy, settings, break_it, phrase):
    break_it(settings, *healthy)
    status, line = check()
    assert status == CHECK_FAILED
    assert line.startswith("attention: ") and phrase in line and line.count("\n") == 1


def test_check_names_the_partition_brake(healthy, settings):
    settings.LLMGW_PARTITION_BRAKE_FRACTION = 0.3
    for i in range(3):
        make_node(f"silent-{i}", gpus=1, state=NodeState.UNREACHABLE)
    status, line = check()
    assert status == CHECK_FAILED and "partition brake engaged" in line and "3 unreachable nodes" in line


def test_watch_redraws_until_ctrl_c_and_exits_quietly(healthy, monkeypatch):
    naps = []

    def sleep(seconds):
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(Command, "sleep", staticmethod(sleep))
    text = run("--watch", "3")
    assert naps == [3, 3]
    assert text.count("llmgw status at") == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--watch", "0"], "--watch must be at least 1 (seconds), got 0"),
        (["--watch", "-2"], "--watch must be at least 1 (seconds), got -2"),
        (["--watch", "2", "--check"], "--check and --watch do not go together"),
    ],
)
def test_bad_watch_is_a_clear_error(args, message):
    with pytest.raises(CommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(*args)


def test_default_text_stays_under_60_lines_on_a_1000_node_fleet():
    bulk_fleet(1000, replicas=2000)
    node_lines = run("--nodes").splitlines()
    assert len(run().splitlines()) < 60
    assert sum(1 for line in node_lines if line.strip().startswith("gpu-")) == 1000


def test_summary_queries_stay_constant_with_failures_and_the_node_list(healthy, django_assert_num_queries):
    _node, profile = healthy
    failed(profile, "boom")
    # Nodes carry their weights; adapter loads; sleepers to stop; continuations; stages.
    with django_assert_num_queries(18) as small:
        cluster_summary()
    for i in range(10):
        make_node(f"more-{i}", gpus=2)
        failed(profile, f"error {i}")
    with django_assert_num_queries(len(small.captured_queries)):
        summary = cluster_summary().as_json()
    assert len(summary["node_list"]) == 11 and len(summary["failed"]) == 11


def test_only_the_five_most_frequent_failure_reasons_print_unless_all(healthy):
    _node, profile = healthy
    for i in range(7):
        for _ in range(7 - i):
            failed(profile, f"reason {i}")
    lines = run().splitlines()
    start = lines.index("Failed replicas") + 2
    assert [line.split()[-1] for line in lines[start : start + 5]] == ["0", "1", "2", "3", "4"]
    assert lines[start + 5] == "  … and 2 more reasons (--all)"
    assert sum(1 for line in run("--all").splitlines() if "reason " in line) == 7


def test_watch_in_a_real_process_ends_quietly_on_ctrl_c(tmp_path):
    """A real `ctl_status --watch 1` on its own SQLite file: two frames, then SIGINT exits 0 without a traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "SECRET_KEY", "REDIS_URL")}
    env |= {"LLMGW_HOME": str(tmp_path), "PYTHONUNBUFFERED": "1"}
    manage = [sys.executable, str(ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "-v", "0"], cwd=ROOT, env=env, check=True, timeout=120)
    process = subprocess.Popen(
        [*manage, "ctl_status", "--watch", "1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # As from a terminal: a suite started in the background by a shell without job control inherits
        # SIGINT ignored, and an ignored SIGINT stays ignored in Python (no KeyboardInterrupt).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert process.stdout is not None
        frames = 0
        while frames < 2:
            line = process.stdout.readline()
            assert line, "ctl_status --watch exited early"
            frames += line.startswith(b"llmgw status at")
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err


def test_default_text_stays_under_60_lines_in_a_troubled_fleet(healthy):
    """Every section in trouble at once: node warnings, unplaceable, held and failing models, broken streams,
    stop candidates. Each section keeps its title and says how much more `--all` shows; the whole fits a screen."""
    now = timezone.now()
    for index in range(12):
        node = make_node(f"gpu-w{index:02}", gpus=2, fabric=f"ib-{index}")
        Node.objects.filter(pk=node.pk).update(reported_address=f"10.0.0.{index}", reported_fabric="other")
        profile = make_model(f"model-{index:02}", min_replicas=1).profiles.get()
        make_replica(profile, placement=[(node, [0])], last_used=now - timedelta(hours=3))
        for hold in (Hold.NONE, Hold.MAKING_ROOM):
            pending = make_replica(profile, state=ReplicaState.PENDING, error=f"no room for {index} ({hold or 'none'})")
            Replica.objects.filter(pk=pending.pk).update(hold=hold)
        failed(profile, f"engine exited with code {index}")
        ContinuationHour.objects.create(model=profile.model.name, hour=now.replace(minute=0), failed=index + 1)
        ModelLoad.objects.create(model=profile.model, pressure=1.0 + index, queue={"batch": {"waiting": index}})
    text = run()
    lines = text.splitlines()
    assert len(lines) <= 60, text
    sections = ("GPU capacity", "Unplaceable", "Held (room being made", "Failed replicas", "What users felt")
    for title in (*sections, "What can I stop"):
        assert any(line.startswith(title) for line in lines), title
    assert any("more node warnings" in line for line in lines)
    assert len(run("--all").splitlines()) > 100  # nothing is lost: --all prints it
    Team.objects.bulk_create(Team(name=f"team-{index:02}") for index in range(12))
    with_teams = run("--teams").splitlines()
    assert len(with_teams) <= 60 and with_teams[-1].startswith("… and ") and with_teams[-1].endswith("lines (--all)")
