"""What users felt per model, in the one summary: latency against the first profile's objectives, the fair queues
per class and each team's share of the tokens against its weight; shown by ctl_status, the REST status and the
dashboard alike."""

from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.utils import timezone
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from catalog.models import Profile
from dashboard.summary import cluster_summary
from dashboard.summary_types import QueueClass, TeamShare
from reconciler.models import ModelLoad, Replica
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db


@pytest.fixture
def pressed():
    model = make_model("llama")
    model.profiles.update(ttft_objective_seconds=0.5, itl_objective_seconds=0.05)
    Profile.objects.create(model=model, order=1, gpu_class="L40S-48GB", ttft_objective_seconds=9.0)  # not the first
    ModelLoad.objects.create(
        model=model,
        ttft_p90=0.62,
        itl_p90=0.04,
        ttft_attained=0.83,
        itl_attained=0.97,
        pressure=1.24,
        queue={"batch": {"waiting": 40, "wait_p90": 12.5}, "interactive": {"waiting": 1, "wait_p90": 0.2}},
        served={"red": {"tokens": 600, "weight": 3}, "blue": {"tokens": 400, "weight": 1}},
    )
    spare = make_replica(model.profiles.get(order=0), placement=[(make_node("gpu-a"), [0])])
    Replica.objects.filter(pk=spare.pk).update(parked_since=timezone.now())
    quiet = make_model("qwen")
    ModelLoad.objects.create(model=quiet, in_flight=3)  # in flight, nothing felt: not listed
    calm = make_model("mistral")
    ModelLoad.objects.create(model=calm, ttft_p90=0.1)
    return model


def test_the_summary_lists_each_model_felt_against_its_first_profiles_objectives_most_pressed_first(pressed):
    felt = cluster_summary().felt
    assert [m.model for m in felt] == ["llama", "mistral"]
    llama = felt[0]
    assert (llama.ttft_p90_seconds, llama.ttft_objective_seconds, llama.ttft_attained) == (0.62, 0.5, 0.83)
    assert (llama.itl_p90_seconds, llama.itl_objective_seconds, llama.pressure) == (0.04, 0.05, 1.24)
    assert llama.parked == 1 and felt[1].parked == 0
    assert llama.queue == [QueueClass("interactive", 1, 0.2), QueueClass("batch", 40, 12.5)]  # by class rank
    assert llama.shares == [TeamShare("red", 600, 0.6, 3, 0.75), TeamShare("blue", 400, 0.4, 1, 0.25)]
    assert felt[1].ttft_objective_seconds is None and felt[1].queue == [] and felt[1].shares == []


def test_ctl_status_prints_a_row_per_model_felt_and_json_keeps_the_figures(pressed):
    out = StringIO()
    call_command("ctl_status", "--all", stdout=out, no_color=True)
    text = out.getvalue()
    section = text[text.index("What users felt") :].splitlines()
    header, llama = section[1].split(), section[2].split()
    assert header[:3] == ["MODEL", "TTFT", "P90"]
    assert llama == ["llama", "0.620s/0.500s", "0.040s/0.050s", "83%/97%", "1.24", "1", "i1", "b40", "12.5s"] + [
        "red",
        "60%(75%)",
        "blue",
        "40%(25%)",
    ]
    out = StringIO()
    call_command("ctl_status", "--json", stdout=out)
    assert '"wait_p90_seconds": 12.5' in out.getvalue() and '"weighted_share": 0.75' in out.getvalue()


def test_ctl_status_says_when_no_model_streamed_or_queued(db):
    out = StringIO()
    call_command("ctl_status", stdout=out, no_color=True)
    assert "  none: no model streamed or queued" in out.getvalue()


def test_the_rest_status_carries_the_same_figures(pressed):
    user = get_user_model().objects.create_user("ops", password="pw", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    llama = client.get("/api/v1/status").json()["felt"][0]
    assert llama["model"] == "llama" and llama["pressure"] == 1.24 and llama["ttft_objective_seconds"] == 0.5
    assert llama["queue"][1] == {"name": "batch", "waiting": 40, "wait_p90_seconds": 12.5}
    assert llama["shares"][0] == {"team": "red", "tokens": 600, "share": 0.6, "weight": 3, "weighted_share": 0.75}


def test_the_dashboard_shows_a_row_per_model_pressed_ones_marked(pressed, admin_client):
    html = admin_client.get("/admin/panels/").content.decode().split('id="felt"')[1]
    rows = html.split('class="felt-row')[1:]
    assert len(rows) == 2
    assert rows[0].startswith(' warn"><td>llama</td><td>0.620s/0.500s</td>')
    assert "<td>red 60%(75%) blue 40%(25%)</td>" in rows[0]
    assert rows[1].startswith('"><td>mistral</td>')


def test_the_dashboard_says_none_when_nothing_was_felt(admin_client):
    assert 'id="felt-none"' in admin_client.get("/admin/panels/").content.decode()


def test_the_fleet_metrics_carry_the_figures_per_model(pressed, client):
    text = client.get("/metrics").content.decode()
    assert 'llmgw_model_latency_p90_seconds{latency="ttft",model="llama"} 0.62' in text
    assert 'llmgw_model_latency_objective_seconds{latency="itl",model="llama"} 0.05' in text
    assert 'llmgw_model_objective_attainment_ratio{latency="ttft",model="llama"} 0.83' in text
    assert 'llmgw_model_objective_pressure{model="llama"} 1.24' in text
    assert 'llmgw_model_queue_waiting{class="batch",model="llama"} 40.0' in text
    assert 'llmgw_model_queue_wait_p90_seconds{class="interactive",model="llama"} 0.2' in text
    assert 'llmgw_model_team_token_share{model="llama",share="weighted",team="red"} 0.75' in text
    assert 'llmgw_model_objective_pressure{model="mistral"}' not in text  # no objective: no pressure
