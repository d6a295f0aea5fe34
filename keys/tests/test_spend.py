"""Spend is stored with the tokens: each hour's row of a key and model holds what its tokens cost at the catalog's
prices when counted (an adapter's own prices, else its base model's; a model the catalog lacks costs nothing),
exactly, in whole 10⁻¹² units, with the key's team and holder."""

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


def tokens(digest: str, per_model: dict[str, tuple[int, int, int]], hour: int = H0) -> dict:
    return {
        hour: {
            digest: {model: TokenCount(requests=r, prompt=p, completion=c) for model, (r, p, c) in per_model.items()}
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


def test_each_rows_spend_is_its_tokens_at_the_prices_exactly(priced):
    _, digest, team, ana = priced
    store_tokens(tokens(digest, {"llama": (3, 1_234_567, 89), "llama-sql": (1, 1000, 500), "unknown": (1, 9, 9)}), {})
    assert spend_of("llama") == Decimal("0.18523845")  # 1,234,567 × 0.15 + 89 × 0.6, per million
    assert spend_of("llama-sql") == Decimal("0.00115")  # its input price is its base's, its output its own: 2
    assert spend_of("unknown") == 0  # not in the catalog (router-only mode): nothing to charge
    row = TokenUsage.objects.get(model="llama")
    assert (row.team, row.user) == (team, ana)


def test_spend_adds_up_exactly_and_follows_a_price_change_from_then_on(priced):
    _, digest, _, _ = priced
    for _ in range(1000):
        store_tokens(tokens(digest, {"llama": (1, 1, 1)}), {})
    assert spend_of("llama") == Decimal("0.00075")  # a thousand times 0.00000075, no float drift
    Model.objects.filter(name="llama").update(price_output_per_million=Decimal("1.2"))
    store_tokens(tokens(digest, {"llama": (1, 0, 1_000_000)}), {})
    assert spend_of("llama") == Decimal("1.20075")
    assert TokenUsage.objects.get(model="llama").spend_units == Decimal("1.20075") * SPEND_UNITS


def test_a_key_moved_to_another_team_leaves_its_earlier_spend_with_the_first(priced):
    key, digest, search, ana = priced
    store_tokens(tokens(digest, {"llama": (1, 100, 100)}, H0), {})
    ads = Team.objects.create(name="ads")
    Membership.objects.create(team=ads, user=ana)
    key.team = ads
    key.save()
    store_tokens(tokens(digest, {"llama": (1, 100, 100)}, H1), {})
    assert list(TokenUsage.objects.order_by("hour").values_list("team__name", flat=True)) == ["search", "ads"]
