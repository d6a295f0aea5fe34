"""`manage.py create_api_key`: scopes, expiry, limits and imported secrets, each bad argument named."""

import datetime as dt
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from catalog.models import Alias, Model
from hub.credentials import hash_secret
from keys.models import ApiKey

IMPORTED = "sk-old-gateway-0123456789abcdef"


def create(*args) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("create_api_key", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


@pytest.fixture
def catalog(db):
    llama = Model.objects.create(name="llama-3-8b", source="meta/llama")
    Alias.objects.create(model=llama, name="llama")


@pytest.mark.django_db
def test_create_api_key_stores_scopes_expiry_and_limits_and_prints_the_key_once(catalog):
    key, said = create(
        "team-a",
        "--models",
        "llama, llama-3-8b",
        "--pools",
        "eu",
        "--expires",
        "2099-01-01",
        "--rpm",
        "60",
        "--tpm",
        "1000",
    )
    api_key = ApiKey.objects.get()
    assert api_key.key_hash == hash_secret(key) and key not in said
    assert api_key.allowed_models == ["llama", "llama-3-8b"] and api_key.allowed_pools == ["eu"]
    assert (api_key.rpm, api_key.tpm) == (60, 1000)
    assert api_key.expires_at == dt.datetime(2099, 1, 1, tzinfo=timezone.get_current_timezone())


@pytest.mark.django_db
def test_create_api_key_imports_an_existing_secret_showing_only_its_start():
    key, said = create("migrated", "--key", IMPORTED)
    api_key = ApiKey.objects.get()
    assert key == IMPORTED and api_key.key_hash == hash_secret(IMPORTED)
    assert api_key.prefix == IMPORTED[:6] and "Imported API key" in said


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--key", "sk-short-123"], "--key: the key is 12 characters long; at least 20 are required"),
        (["--key", "sk-has a space in the middle"], "--key: the key must not contain spaces"),
        (["--models", "llama,mistral"], "--models: unknown model `mistral`"),
        (["--expires", "2001-01-01"], "--expires '2001-01-01': that is in the past"),
        (["--expires", "next tuesday"], "--expires 'next tuesday': expected a date (2027-01-01)"),
        (["--expires", "2027-02-30"], "--expires '2027-02-30': day is out of range for month"),
        (["--rpm", "0"], "--rpm: 0 is not a positive number"),
        (["--tpm", "-5"], "--tpm: -5 is not a positive number"),
        (["--tpm", "lots"], "--tpm: 'lots' is not a whole number"),
    ],
)
def test_create_api_key_refuses_bad_arguments_naming_them(catalog, args, problem):
    with pytest.raises(CommandError) as refused:
        create("team-a", *args)
    assert str(refused.value).startswith(problem)
    assert not ApiKey.objects.exists()


@pytest.mark.django_db
def test_create_api_key_refuses_to_import_a_key_already_stored():
    create("first", "--key", IMPORTED)
    with pytest.raises(CommandError, match="--key: this key is already stored"):
        create("second", "--key", IMPORTED)
    assert ApiKey.objects.count() == 1
