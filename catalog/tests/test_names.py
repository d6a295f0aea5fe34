"""Model names and aliases share one namespace; `name_clash` is the one rule every form and clean() asks."""

import pytest
from django.core.exceptions import ValidationError

from catalog.models import Alias, Model, name_clash

pytestmark = pytest.mark.django_db


@pytest.fixture
def llama():
    model = Model.objects.create(name="llama-70b", source="org/llama")
    Alias.objects.create(model=model, name="llama")
    return model


def test_a_name_taken_by_a_model_or_an_alias_is_named(llama):
    assert name_clash("llama-70b") == "“llama-70b” is already the name of model “llama-70b”"
    assert name_clash("llama") == "“llama” is already an alias of model “llama-70b”"
    assert name_clash("qwen") is None


def test_an_alias_does_not_clash_with_itself_and_must_differ_from_its_model(llama):
    alias = Alias.objects.get(name="llama")
    assert name_clash("llama", models=False, alias_pk=alias.pk) is None
    assert name_clash("qwen", own_model_name="qwen") == "“qwen” is this model's own name; an alias must differ from it"


def test_model_and_alias_clean_refuse_each_others_names(llama):
    with pytest.raises(ValidationError, match="already an alias of model"):
        Model(name="llama", source="org/x").full_clean()
    with pytest.raises(ValidationError, match="already the name of model"):
        Alias(model=llama, name="llama-70b").full_clean()
