"""An API key is stored as its hash and a recognisable prefix; its plaintext is returned once."""

from decimal import Decimal

import pytest
from django.core.exceptions import ValidationError

from hub.credentials import hash_secret
from keys.models import KEY_PREFIX, ApiKey, Budget
from teams.models import Team

pytestmark = pytest.mark.django_db


def test_an_issued_key_is_stored_only_as_its_hash_and_prefix():
    api_key, plaintext = ApiKey.issue("hashed")
    assert plaintext.startswith(KEY_PREFIX) and len(plaintext) > len(KEY_PREFIX) + 32
    api_key.refresh_from_db()
    assert api_key.key_hash == hash_secret(plaintext) != plaintext
    assert api_key.prefix == plaintext[: len(KEY_PREFIX) + 6]


def test_a_second_budget_for_one_scope_and_window_is_refused_in_words():
    team = Team.objects.create(name="ml")
    Budget.objects.create(team=team, amount=Decimal("1"), window="day")
    with pytest.raises(ValidationError) as refused:
        Budget(team=team, amount=Decimal("2"), window="day").full_clean()
    assert refused.value.messages == ["This team already has a budget for that window."]
    Budget(team=team, amount=Decimal("2"), window="month").full_clean()  # another window: fine
