"""The endpoint table carries each model's and adapter's token prices (whole spend units per token, from the
catalog's price per million) and the longest answer a model's profiles allow, so routers charge and reserve
without asking the catalog; a free model publishes no price at all."""

from decimal import Decimal

import msgspec
import pytest

from catalog.models import Adapter, Model, Profile
from reconciler.endpoints import build_endpoint_table, token_price
from tests.fleet import make_model

pytestmark = pytest.mark.django_db


def test_prices_and_the_output_bound_are_published_and_an_adapter_inherits_what_it_does_not_set():
    llama = make_model("llama")
    Model.objects.filter(pk=llama.pk).update(
        price_input_per_million=Decimal("0.15"), price_output_per_million=Decimal("0.600001")
    )
    Profile.objects.filter(model=llama).update(max_model_len=8192)
    Profile.objects.create(model=llama, order=1, gpu_class="L40S-48GB", pool="gold", max_model_len=32768)
    Adapter.objects.create(name="sql", base=llama, source="org/sql", price_output_per_million=Decimal("2"))
    make_model("free")

    table = build_endpoint_table()
    entry = table.models["llama"]
    assert (entry.price_input, entry.price_output, entry.output_bound) == (150_000, 600_001, 32768)
    assert (table.adapters["sql"].price_input, table.adapters["sql"].price_output) == (150_000, 2_000_000)
    # Nothing of it on the wire for a free model of unknown context: its entry is the same bytes as before.
    assert b"price" not in msgspec.json.encode(table.models["free"])


def test_a_token_price_is_exact_to_the_catalogs_six_decimals():
    assert token_price(Decimal("0.000001")) == 1  # a millionth per million tokens: one spend unit a token
    assert token_price(Decimal("99999999.999999")) == 99_999_999_999_999
