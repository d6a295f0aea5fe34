"""LoRA adapters on every operator surface: the summary's counts, ctl_status, /metrics, the replicas API, /admin."""

import json
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from catalog.models import Adapter
from dashboard.summary import cluster_summary
from dashboard.tests.api.test_read import count_queries
from dashboard.tests.api.test_writes import client_for
from dashboard.tests.test_metrics import scrape
from reconciler.choices import AdapterLoadState, ReplicaState
from reconciler.models import AdapterLoad, AdapterStats
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

LOADED, LOADING, UNLOADING = AdapterLoadState.LOADED, AdapterLoadState.LOADING, AdapterLoadState.UNLOADING


def load(adapter, replica, state):
    now = timezone.now()
    return AdapterLoad.objects.create(
        adapter=adapter, replica=replica, state=state, requested_at=now, loaded_at=now if state == LOADED else None
    )


@pytest.fixture
def lora():
    """llama (4 slots a replica) on three ready replicas and a starting one; qwen takes no adapters.

    Five enabled adapters and a disabled one still loaded: first holds a0, a1 and is loading a2; second holds
    a3 and the disabled one and is unloading a4; third holds none.
    """
    node = make_node("gpu-a", gpus=4)
    llama = make_model("llama", engine="vllm", sleep_level=0, max_adapters=4, max_adapter_rank=16, max_replicas=4)
    profile = llama.profiles.get()
    first, second, third = (make_replica(profile, placement=[(node, [i])]) for i in range(3))
    make_replica(profile, state=ReplicaState.STARTING, placement=[(node, [3])])  # not ready: no slots yet
    make_model("qwen", min_replicas=0)
    a = [Adapter.objects.create(name=f"a{i}", base=llama, source=f"org/a{i}") for i in range(5)]
    retired = Adapter.objects.create(name="retired", base=llama, source="org/retired", enabled=False)
    for adapter, replica, state in [
        (a[0], first, LOADED),
        (a[1], first, LOADED),
        (a[2], first, LOADING),
        (a[3], second, LOADED),
        (a[4], second, UNLOADING),
        (retired, second, LOADED),
    ]:
        load(adapter, replica, state)
    return first, second, third


@pytest.fixture
def staff():
    return client_for(get_user_model().objects.create_user("ops", password="pw", is_staff=True))


def run(*args) -> str:
    out = StringIO()
    call_command("ctl_status", *args, stdout=out)
    return out.getvalue()


def test_summary_counts_a_bases_adapters_and_each_replicas_loads(lora):
    first, second, third = lora
    summary = cluster_summary()
    models = {m.name: m.adapters for m in summary.models}
    # Registered: enabled only. Loaded counts loads, the disabled one's too; unloading has given its slot up.
    assert models["llama"].items() == [("registered", 5), ("loaded", 4), ("loading", 1), ("slots", 12)]
    assert models["llama"].shown and not models["qwen"].shown
    assert models["qwen"].items() == [("registered", 0), ("loaded", 0), ("loading", 0), ("slots", 0)]
    per_replica = {r.id: (r.adapters_loaded, r.adapters_loading) for r in summary.replica_list}
    assert [per_replica[r.pk] for r in (first, second, third)] == [(2, 1), (2, 0), (0, 0)]


def test_a_disabled_base_still_shows_adapters_loaded_until_they_go(lora):
    Adapter.objects.update(enabled=False)
    llama = next(m for m in cluster_summary().models if m.name == "llama")
    assert (llama.adapters.registered, llama.adapters.loaded, llama.adapters.shown) == (0, 4, True)


def test_summary_queries_are_the_same_for_1_and_1000_adapters(django_assert_num_queries):
    node = make_node("gpu-a", gpus=2)
    llama = make_model("llama", engine="vllm", sleep_level=0, max_adapters=1000, max_replicas=2)
    replicas = [make_replica(llama.profiles.get(), placement=[(node, [i])]) for i in range(2)]
    load(Adapter.objects.create(name="only", base=llama, source="org/only"), replicas[0], LOADED)
    with CaptureQueriesContext(connection) as one:
        cluster_summary()
    adapters = Adapter.objects.bulk_create(
        Adapter(name=f"lora-{i:04d}", base=llama, source=f"org/lora-{i}") for i in range(999)
    )
    now = timezone.now()
    states = [LOADED, LOADING, UNLOADING]
    AdapterLoad.objects.bulk_create(
        AdapterLoad(adapter=a, replica=replicas[i % 2], state=states[i % 3], requested_at=now)
        for i, a in enumerate(adapters)
    )
    with django_assert_num_queries(len(one)) as many:
        summary = cluster_summary()
    [counted] = [q["sql"] for q in many.captured_queries if '"reconciler_adapterload"' in q["sql"]]
    assert "GROUP BY" in counted and "COUNT(" in counted  # counted in SQL, not row by row
    llama_adapters = summary.models[0].adapters
    assert llama_adapters.items() == [("registered", 1000), ("loaded", 334), ("loading", 333), ("slots", 2000)]
    assert sum(r.adapters_loaded + r.adapters_loading for r in summary.replica_list) == 667


def test_ctl_status_prints_one_line_of_counts_per_base_with_adapters(lora):
    lines = run().splitlines()
    adapter_lines = [line for line in lines if line.startswith("  adapters ")]
    assert adapter_lines == ["  adapters  llama  5 registered, 4 loaded, 1 loading, 12 slots"]
    assert not any(line.strip().startswith(("a0", "a1", "retired")) for line in lines)  # never one per adapter


def test_ctl_status_json_carries_the_adapter_counts(lora):
    first, _second, _third = lora
    data = json.loads(run("--json"))
    llama = next(m for m in data["models"] if m["name"] == "llama")
    assert llama["adapters"] == {"registered": 5, "loaded": 4, "loading": 1, "slots": 12}
    row = next(r for r in data["replica_list"] if r["id"] == first.pk)
    assert (row["adapters_loaded"], row["adapters_loading"]) == (2, 1)


def test_ctl_status_replica_list_shows_each_replicas_adapters(lora):
    first, second, third = lora
    lines = run("--replicas").splitlines()
    header = next(line for line in lines if line.split()[:2] == ["ID", "MODEL"])
    column = header.split().index("ADAPTERS")
    rows = {line.split()[0]: line.split() for line in lines if line.strip()[:1].isdigit()}
    assert [rows[str(r.pk)][column] for r in (first, second, third)] == ["2+1", "2", "0"]


def test_metrics_count_adapters_per_base_and_state_and_loaded_per_replica(client, lora):
    first, second, third = lora
    samples = scrape(client)
    base = (("model", "llama"),)
    for state, count in [("registered", 5), ("loaded", 4), ("loading", 1)]:
        assert samples[("llmgw_adapters", (("model", "llama"), ("state", state)))] == count
    assert samples[("llmgw_adapter_slots", base)] == 12
    # Nothing answered yet: the counters are 0 and no load time is learned.
    assert samples[("llmgw_adapter_loads_total", base)] == samples[("llmgw_adapter_load_failures_total", base)] == 0
    assert ("llmgw_adapter_load_seconds", base) not in samples
    AdapterStats.objects.create(model_id=first.model_id, loads=7, failures=2, load_seconds=1.5)
    samples = scrape(client)
    assert samples[("llmgw_adapter_loads_total", base)] == 7
    assert samples[("llmgw_adapter_load_failures_total", base)] == 2
    assert samples[("llmgw_adapter_load_seconds", base)] == 1.5
    for replica, loaded in [(first, 2), (second, 2), (third, 0)]:
        assert samples[("llmgw_replica_adapters", (("model", "llama"), ("replica", str(replica.pk))))] == loaded
    # A model without adapters has no series: a catalog of thousands of models must not cost three each.
    adapter_series = [labels for name, labels in samples if "adapter" in name]
    assert adapter_series and not [labels for labels in adapter_series if ("model", "qwen") in labels]


def test_replicas_api_names_each_replicas_adapters_loaded_and_loading(staff, lora):
    first, second, third = lora
    rows = {r["id"]: r for r in staff.get("/api/v1/replicas").json()["results"]}
    assert rows[first.pk]["adapters"] == {"loaded": ["a0", "a1"], "loading": ["a2"]}
    assert rows[second.pk]["adapters"] == {"loaded": ["a3", "retired"], "loading": []}  # unloading: not listed
    assert rows[third.pk]["adapters"] == {"loaded": [], "loading": []}
    assert staff.get(f"/api/v1/replicas/{first.pk}").json()["adapters"]["loading"] == ["a2"]


def test_replicas_api_queries_do_not_grow_with_adapters(staff, lora):
    first, second, _third = lora
    small = count_queries(staff, "/api/v1/replicas")
    llama = first.model
    more = Adapter.objects.bulk_create(Adapter(name=f"x{i}", base=llama, source=f"org/x{i}") for i in range(50))
    AdapterLoad.objects.bulk_create(
        AdapterLoad(adapter=a, replica=(first, second)[i % 2], state=LOADED, requested_at=timezone.now())
        for i, a in enumerate(more)
    )
    assert count_queries(staff, "/api/v1/replicas") == small


def test_dashboard_shows_a_bases_adapter_counts_and_each_replicas(admin_client, lora):
    first, _second, third = lora
    html = admin_client.get("/admin/").content.decode()
    assert '<td class="adapters">5 registered, 4 loaded, 1 loading, 12 slots</td>' in html
    assert '<td>qwen</td><td>yes</td><td>0</td><td>0</td>\n          <td class="adapters">-</td>' in html
    cells = {
        replica.pk: html[html.index(f"<tr><td>{replica.pk}</td>") :].split('<td class="adapters"', 1)[1]
        for replica in (first, third)
    }
    assert cells[first.pk].split(">", 1)[1].startswith("2 +1 loading</td>")
    assert cells[third.pk].split(">", 1)[1].startswith("0</td>")
