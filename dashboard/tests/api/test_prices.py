"""Prices per million tokens through the REST API: read as exact decimal strings, written as numbers or strings,
a bad one answered 400 naming the field with nothing written."""

from decimal import Decimal

import pytest
from django.contrib.auth import get_user_model

from catalog.models import Adapter, Model
from catalog.prices import Prices
from dashboard.tests.api.test_writes import client_for

pytestmark = pytest.mark.django_db

PROFILE = {"engine": "vllm", "gpu_class": "H100-80GB", "max_adapters": 4}


@pytest.fixture
def staff():
    return client_for(get_user_model().objects.create_user("ops", password="pw", is_staff=True))


def llama(**fields):
    return {"name": "llama", "source": "meta/llama", "profiles": [PROFILE], **fields}


def test_prices_are_written_as_numbers_or_strings_and_read_as_exact_strings(staff):
    sql = {"name": "sql", "source": "org/sql", "price_output_per_million": "1.2"}
    body = llama(price_input_per_million=0.15, price_output_per_million="0.60", adapters=[sql])
    response = staff.post("/api/v1/models/", body, format="json")
    assert response.status_code == 201, response.json()
    answer = response.json()
    assert (answer["price_input_per_million"], answer["price_output_per_million"]) == ("0.150000", "0.600000")
    assert answer["adapters"][0]["price_input_per_million"] is None  # its base model's
    assert answer["adapters"][0]["price_output_per_million"] == "1.200000"
    assert Adapter.objects.select_related("base").get().prices == Prices(Decimal("0.15"), Decimal("1.2"))


def test_a_patch_changes_one_price_and_keeps_the_others(staff):
    body = llama(price_input_per_million="0.15", price_output_per_million="0.6")
    assert staff.post("/api/v1/models/", body, format="json").status_code == 201
    response = staff.patch("/api/v1/models/llama", {"price_output_per_million": 0.9}, format="json")
    assert response.status_code == 200, response.json()
    assert Model.objects.get().prices == Prices(Decimal("0.15"), Decimal("0.9"))


@pytest.mark.parametrize(
    ("prices", "problem"),
    [
        (
            {"price_input_per_million": -0.15},
            "price_input_per_million: A price cannot be negative; 0 means free.",
        ),
        ({"price_output_per_million": "cheap"}, "price_output_per_million: A valid number is required."),
        (
            {"price_input_per_million": True},
            'price_input_per_million: expected a number such as 0.15 or a string of one ("0.15"), got true (a boolean)',
        ),
        (
            {"price_input_per_million": "0.1234567"},
            "price_input_per_million: Ensure that there are no more than 6 decimal places.",
        ),
        ({"price_input_per_million": None}, "price_input_per_million: This field may not be null."),
    ],
)
def test_a_bad_price_is_a_400_naming_the_field_and_nothing_is_written(staff, prices, problem):
    response = staff.post("/api/v1/models/", llama(**prices), format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == [problem]
    assert not Model.objects.exists()


def test_a_bad_adapter_price_is_a_400_naming_the_adapter(staff):
    body = llama(adapters=[{"name": "sql", "source": "org/sql", "price_input_per_million": "-1"}])
    response = staff.post("/api/v1/models/", body, format="json")
    assert response.status_code == 400
    assert response.json()["errors"] == [
        "adapters[0].price_input_per_million: A price cannot be negative; 0 means free."
    ]
    assert not Adapter.objects.exists()
