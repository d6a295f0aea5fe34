"""A key's model scope may name LoRA adapters (by name or alias); unknown names are still refused."""

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from catalog.models import Adapter, Model, Profile
from keys.models import ApiKey
from keys.scopes import unknown_models

pytestmark = pytest.mark.django_db


@pytest.fixture
def llama_with_sql():
    llama = Model.objects.create(name="llama-8b", source="org/llama")
    Profile.objects.create(model=llama, gpu_class="H100-80GB", max_adapters=4)
    Adapter.objects.create(name="sql", base=llama, source="org/sql", aliases=["sql-bot"])


def test_a_scope_may_name_adapters_and_their_aliases(llama_with_sql):
    assert unknown_models(["llama-8b", "sql", "sql-bot"]) == []
    assert unknown_models(["sql", "chat"]) == ["chat"]


def test_create_api_key_takes_an_adapter_scope_and_names_an_unknown_one(llama_with_sql):
    call_command("create_api_key", "team-a", "--models", "sql-bot", stdout=StringIO())
    assert ApiKey.objects.get(name="team-a").allowed_models == ["sql-bot"]
    with pytest.raises(CommandError) as raised:
        call_command("create_api_key", "team-b", "--models", "llama-8b,chat", stdout=StringIO())
    assert str(raised.value) == (
        "--models: unknown model `chat`: name models, adapters or aliases from the catalog (see the admin's Models page)"
    )
