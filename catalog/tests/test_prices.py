"""Prices per million tokens: exact Decimal costs, adapters that cost what their model costs unless priced, and
prices set, shown and refused alike in the admin and the catalog file, which exports and applies them exactly."""

from decimal import Decimal

import pytest

from catalog.as_code import Verdict, apply_catalog, dump_catalog, export_catalog
from catalog.catalog_file import CatalogFileError, load_catalog_text
from catalog.models import Adapter, Model, Profile
from catalog.prices import Prices, cost, price_text
from catalog.tests.test_admin import ADD_URL, model_form

FILE = """\
models:
- name: llama-8b
  source: org/llama-8b
  price_input_per_million: 0.15
  price_output_per_million: "0.60"
  profiles:
  - {engine: vllm, gpu_class: H100-80GB, max_adapters: 8}
  adapters:
  - {name: sql, source: org/sql, price_output_per_million: 1.2}
  - {name: chat, source: org/chat}
"""


@pytest.fixture
def llama(db):
    model = Model.objects.create(
        name="llama-8b",
        source="org/llama-8b",
        price_input_per_million=Decimal("0.15"),
        price_output_per_million=Decimal("0.60"),
    )
    Profile.objects.create(model=model, gpu_class="H100-80GB", max_adapters=8)
    return model


def test_a_cost_is_exact_to_the_last_digit():
    assert cost(1_234_567, 89, Decimal("0.15"), Decimal("0.60")) == Decimal("0.18523845")
    assert cost(1, 0, Decimal("0.000001"), Decimal("99999999.999999")) == Decimal("1E-12")
    # A quadrillion tokens at the largest price a catalog stores: 30 digits, where Decimal's default context
    # would round to 28 (…8200.0000).
    huge = cost(10**15 + 1, 10**15 + 1, Decimal("99999999.999999"), Decimal("99999999.999999"))
    assert huge == Decimal("199999999999998199.999999999998")
    assert cost(0, 0, Decimal("5"), Decimal("5")) == 0


def test_a_cost_refuses_negative_tokens_and_prices_that_are_not_decimals():
    with pytest.raises(ValueError, match="prompt_tokens must be a whole number of tokens, 0 or more, not -1"):
        cost(-1, 0, Decimal(1), Decimal(1))
    with pytest.raises(ValueError, match="price_out must be a Decimal price, 0 or more, not 0.6"):
        cost(1, 1, Decimal(1), 0.6)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="price_in must be a Decimal price"):
        cost(1, 1, Decimal("-0.1"), Decimal(1))


def test_prices_cost_a_request_and_print_without_trailing_zeros():
    assert Prices(Decimal("0.15"), Decimal("0.60")).cost(1_234_567, 89) == Decimal("0.18523845")
    assert [price_text(Decimal(p)) for p in ("0.150000", "100.000000", "0.000000")] == ["0.15", "100", "0"]


def test_a_model_is_free_unless_priced(db):
    model = Model.objects.create(name="qwen", source="org/qwen")
    model.refresh_from_db()
    assert model.prices == Prices(Decimal(0), Decimal(0))


def test_an_adapter_without_prices_costs_what_its_base_model_costs(llama):
    Adapter.objects.create(name="chat", base=llama, source="org/chat")
    adapter = Adapter.objects.select_related("base").get(name="chat")
    assert adapter.prices == Prices(Decimal("0.15"), Decimal("0.60"))
    assert adapter.prices.cost(1_234_567, 89) == Decimal("0.18523845")


def test_an_adapter_priced_for_output_only_takes_its_base_models_input_price(llama):
    Adapter.objects.create(name="sql", base=llama, source="org/sql", price_output_per_million=Decimal("1.2"))
    assert Adapter.objects.get(name="sql").prices == Prices(Decimal("0.15"), Decimal("1.2"))
    Adapter.objects.filter(name="sql").update(price_input_per_million=Decimal(0))
    assert Adapter.objects.get(name="sql").prices == Prices(Decimal(0), Decimal("1.2"))  # 0 is free, not unset


def test_the_admin_saves_prices_and_lists_them(admin_client):
    response = admin_client.post(ADD_URL, model_form("qwen", profiles=[{}], prices=("0.15", "0.6")))
    assert response.status_code == 302
    assert Model.objects.get(name="qwen").prices == Prices(Decimal("0.15"), Decimal("0.6"))
    listing = admin_client.get("/admin/catalog/model/").content.decode()
    assert "Price per million (in / out)" in listing
    assert '<td class="field-price">0.15 / 0.6</td>' in listing


def test_the_admin_shows_the_prices_in_their_own_section(admin_client, llama):
    page = admin_client.get(f"/admin/catalog/model/{llama.pk}/change/")
    fieldsets = {fieldset.name: [line.fields for line in fieldset] for fieldset in page.context["adminform"]}
    assert list(fieldsets) == [None, "Price"]
    assert fieldsets["Price"] == [("price_input_per_million", "price_output_per_million")]
    assert ["source"] in fieldsets[None] and ["head_dim"] in fieldsets[None]  # the other fields stay
    html = page.content.decode()
    assert 'name="price_input_per_million" value="0.150000"' in html
    assert 'name="adapters-__prefix__-price_output_per_million"' in html


@pytest.mark.parametrize(
    ("prices", "field", "message"),
    [
        (("-0.01", "0"), "price_input_per_million", "A price cannot be negative; 0 means free."),
        (("0", "cheap"), "price_output_per_million", "Enter a number."),
        (("0.0000001", "0"), "price_input_per_million", "Ensure that there are no more than 6 decimal places."),
    ],
)
def test_the_admin_refuses_a_bad_price_beside_its_field_and_saves_nothing(admin_client, prices, field, message):
    response = admin_client.post(ADD_URL, model_form("qwen", profiles=[{}], prices=prices))
    assert response.status_code == 200
    assert response.context["adminform"].form.errors == {field: [message]}
    assert not Model.objects.filter(name="qwen").exists()


def test_the_admin_refuses_a_negative_adapter_price_on_its_row(admin_client):
    adapters = [{"name": "sql", "source": "org/sql", "price_output_per_million": "-1"}]
    data = model_form("qwen", profiles=[{"max_adapters": "4"}], adapters=adapters)
    response = admin_client.post(ADD_URL, data)
    assert response.status_code == 200
    adapter_forms = next(f for f in response.context["inline_admin_formsets"] if f.formset.prefix == "adapters")
    # (Its base, being added, has no saved profile to take it yet: a second error on the row, not this test's.)
    assert adapter_forms.formset.errors[0]["price_output_per_million"] == ["A price cannot be negative; 0 means free."]
    assert not Model.objects.filter(name="qwen").exists()


def test_a_catalog_file_sets_prices_from_numbers_and_strings_exactly(db):
    apply_catalog(load_catalog_text(FILE))
    assert Model.objects.get().prices == Prices(Decimal("0.15"), Decimal("0.60"))
    adapters = {a.name: a for a in Adapter.objects.select_related("base")}
    assert adapters["sql"].price_input_per_million is None
    assert adapters["sql"].prices == Prices(Decimal("0.15"), Decimal("1.2"))
    assert adapters["chat"].prices == Prices(Decimal("0.15"), Decimal("0.60"))


def test_prices_round_trip_through_export_and_apply(db):
    apply_catalog(load_catalog_text(FILE.replace("0.15", "12345678.000001")))
    text = dump_catalog(export_catalog())
    # Plain numbers, no trailing zeros; an adapter's unset price and a free model's stay out of the file.
    assert "  price_input_per_million: 12345678.000001\n  price_output_per_million: 0.6\n" in text
    assert "    aliases: []\n    price_output_per_million: 1.2\n" in text
    adapters = {a["name"]: a for a in load_catalog_text(text)["models"][0]["adapters"]}
    assert "price_input_per_million" not in adapters["sql"]
    assert not {"price_input_per_million", "price_output_per_million"} & adapters["chat"].keys()
    assert apply_catalog(load_catalog_text(text)).models[0].verdict == Verdict.LEFT_ALONE

    Model.objects.all().delete()
    apply_catalog(load_catalog_text(text))
    model = Model.objects.get()
    assert (model.price_input_per_million, model.price_output_per_million) == (
        Decimal("12345678.000001"),
        Decimal("0.6"),
    )
    assert Adapter.objects.get(name="sql").price_output_per_million == Decimal("1.2")
    assert dump_catalog(export_catalog()) == text


def test_a_changed_price_is_planned_and_written_and_a_dropped_one_is_free_again(db):
    apply_catalog(load_catalog_text(FILE))
    changed = FILE.replace("price_input_per_million: 0.15", "price_input_per_million: 0.2").replace(
        ", price_output_per_million: 1.2", ", price_input_per_million: 0.05"
    )
    plan = apply_catalog(load_catalog_text(changed))
    assert plan.models[0].line() == (
        "changed      llama-8b: price_input_per_million; "
        "adapters ~sql (price_input_per_million, price_output_per_million)"
    )
    sql = Adapter.objects.select_related("base").get(name="sql")
    assert sql.prices == Prices(Decimal("0.05"), Decimal("0.60"))
    apply_catalog(load_catalog_text(changed.replace('  price_output_per_million: "0.60"\n', "")))
    assert Model.objects.get().price_output_per_million == 0


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("price_input_per_million: -0.15", "price_input_per_million: A price cannot be negative; 0 means free."),
        (
            "price_input_per_million: cheap",
            'price_input_per_million: expected a number such as 0.15 (or a string of one, "0.15"), '
            "got a string ('cheap')",
        ),
        (
            "price_input_per_million: true",
            'price_input_per_million: expected a number such as 0.15 (or a string of one, "0.15"), '
            "got true (true/false)",
        ),
        (
            "price_input_per_million: .nan",
            'price_input_per_million: expected a number such as 0.15 (or a string of one, "0.15"), got a number (nan)',
        ),
        (
            "price_input_per_million: 0.1234567",
            "price_input_per_million: Ensure that there are no more than 6 decimal places.",
        ),
        (
            "price_input_per_million: 123456789",
            "price_input_per_million: Ensure that there are no more than 8 digits before the decimal point.",
        ),
        (
            "price_input_per_million: null",
            "price_input_per_million: empty; give a value or leave the key out for the default",
        ),
    ],
)
def test_a_bad_price_in_a_file_is_named_with_its_model_and_nothing_is_written(db, line, problem):
    text = FILE.replace("price_input_per_million: 0.15", line)
    with pytest.raises(CatalogFileError) as raised:
        apply_catalog(load_catalog_text(text))
    assert raised.value.messages == [f'models[0] "llama-8b": {problem}']
    assert not Model.objects.exists()


def test_a_bad_adapter_price_in_a_file_is_named_with_its_adapter(db):
    text = FILE.replace("price_output_per_million: 1.2", "price_output_per_million: -1")
    with pytest.raises(CatalogFileError) as raised:
        apply_catalog(load_catalog_text(text))
    assert raised.value.messages == [
        'models[0] "llama-8b": adapters[0].price_output_per_million: A price cannot be negative; 0 means free.'
    ]
