"""Spend is stored with the tokens: each hour's row of a key and model adds up what the routers charged, exactly,
in whole 10⁻¹² units, with the key's team and holder then. (What an answer costs is the router's to say, at the
prices the endpoint table carries: reconciler/tests/test_table_prices.py, router/tests/accounting.)"""

from decimal import Decimal

import pytest
from django.contrib.auth.models import User

from catalog.models import Adapter, Model
from hub.contracts import TokenCount
from keys.models import SPEND_UNITS, ApiKey, TokenUsage
from keys.usage import store_tokens
from teams.models import Membership, Team

pytestmark = pytest.mark.django_db

H0 = 1_800_000_000
H1 = H0 + 3600


def tokens(digest: str, per_model: dict[str, tuple[int, int, int, int]], hour: int = H0) -> dict:
    return {
        hour: {
            digest: {
                model: TokenCount(requests=r, prompt=p, completion=c, spend=s)
                for model, (r, p, c, s) in per_model.items()
            }
        }
    }


@pytest.fixture
def priced():
    llama = Model.objects.create(
        name="llama",
        source="meta/llama",
        price_input_per_million=Decimal("0.15"),
        price_output_per_million=Decimal("0.6"),
    )
    Adapter.objects.create(name="llama-sql", base=llama, source="org/sql", price_output_per_million=Decimal("2"))
    team = Team.objects.create(name="search")
    ana = User.objects.create_user("ana")
    Membership.objects.create(team=team, user=ana)
    key, _ = ApiKey.issue("ana's", team=team, user=ana)
    return key, ApiKey.objects.get(pk=key.pk).key_hash, team, ana


def spend_of(model: str) -> Decimal:
    return TokenUsage.objects.get(model=model).spend


def test_each_rows_spend_is_what_the_routers_charged_exactly(priced):
    _, digest, team, ana = priced
    store_tokens(tokens(digest, {"llama": (3, 1_234_567, 89, 185_238_450_000), "llama-sql": (1, 1000, 500, 0)}), {})
    assert spend_of("llama") == Decimal("0.18523845")
    assert spend_of("llama-sql") == 0
    row = TokenUsage.objects.get(model="llama")
    assert (row.team, row.user) == (team, ana)


def test_spend_adds_up_exactly(priced):
    _, digest, _, _ = priced
    for _ in range(1000):
        store_tokens(tokens(digest, {"llama": (1, 1, 1, 750_000)}), {})
    assert spend_of("llama") == Decimal("0.00075")  # a thousand times 0.00000075, no float drift
    store_tokens(tokens(digest, {"llama": (0, 0, 0, 12_345 * SPEND_UNITS + 1)}), {})  # a budget's settlement alone
    row = TokenUsage.objects.get(model="llama")
    assert row.spend_units == 750_000_000 + 12_345 * SPEND_UNITS + 1 and row.requests == 1000


def test_a_key_moved_to_another_team_leaves_its_earlier_spend_with_the_first(priced):
    key, digest, search, ana = priced
    store_tokens(tokens(digest, {"llama": (1, 100, 100, 5)}, H0), {})
    ads = Team.objects.create(name="ads")
    Membership.objects.create(team=ads, user=ana)
    key.team = ads
    key.save()
    store_tokens(tokens(digest, {"llama": (1, 100, 100, 5)}, H1), {})
    assert list(TokenUsage.objects.order_by("hour").values_list("team__name", flat=True)) == ["search", "ads"]
