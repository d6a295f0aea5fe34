"""LoRA adapters through the REST API: nested under their base model, read and written with it."""

import pytest
from django.contrib.auth import get_user_model

from catalog.models import Adapter
from dashboard.tests.api.test_read import count_queries
from dashboard.tests.api.test_writes import client_for

pytestmark = pytest.mark.django_db

PROFILE = {"engine": "vllm", "gpu_class": "H100-80GB", "max_adapters": 4, "max_adapter_rank": 16}
SQL = {"name": "sql", "source": "org/sql", "enabled": True, "rank": 8, "aliases": ["sql-bot"]}
# An adapter without prices of its own reads them as null: it costs what its base model costs.
UNPRICED = {"price_input_per_million": None, "price_output_per_million": None}


@pytest.fixture
def staff():
    return client_for(get_user_model().objects.create_user("ops", password="pw", is_staff=True))


def test_a_model_is_created_read_and_changed_with_its_adapters(staff):
    body = {"name": "llama", "source": "meta/llama", "profiles": [PROFILE], "adapters": [SQL]}
    response = staff.post("/api/v1/models/", body, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["adapters"] == [SQL | UNPRICED]
    assert response.json()["profiles"][0]["max_adapters"] == 4
    chat = {"name": "chat", "source": "org/chat"}
    response = staff.patch("/api/v1/models/llama", {"adapters": [chat]}, format="json")
    assert response.status_code == 200, response.json()
    assert staff.get("/api/v1/models/llama").json()["adapters"] == [
        {"name": "chat", "source": "org/chat", "enabled": True, "rank": None, "aliases": []} | UNPRICED
    ]
    assert list(Adapter.objects.values_list("name", flat=True)) == ["chat"]


def test_a_bad_adapter_is_answered_400_naming_it_and_nothing_is_written(staff):
    body = {"name": "llama", "source": "meta/llama", "profiles": [PROFILE], "adapters": [{**SQL, "rank": 32}]}
    response = staff.post("/api/v1/models/", body, format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == [
        "adapters[0].rank: Rank 32 is above the max adapter rank 16 of model “llama”'s profiles."
    ]
    body = {"name": "sql-bot", "source": "s", "profiles": [PROFILE]}
    staff.post("/api/v1/models/", {**body, "name": "llama", "adapters": [SQL]}, format="json")
    response = staff.post("/api/v1/models/", body, format="json")
    assert response.json()["errors"] == ["name: “sql-bot” is already an alias of adapter “sql”"]


def test_the_model_list_reads_a_constant_number_of_queries_with_adapters(staff):
    def model_with_adapters(name, count):
        adapters = [{"name": f"{name}-a{i}", "source": f"org/{name}-{i}"} for i in range(count)]
        body = {"name": name, "source": f"org/{name}", "profiles": [PROFILE], "adapters": adapters}
        assert staff.post("/api/v1/models/", body, format="json").status_code == 201

    model_with_adapters("one", 1)
    few = count_queries(staff, "/api/v1/models")
    for i in range(5):
        model_with_adapters(f"m{i}", 10)
    assert count_queries(staff, "/api/v1/models") == few
