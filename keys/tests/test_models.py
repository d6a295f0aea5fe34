"""An API key is stored as its hash and a recognisable prefix; its plaintext is returned once."""

import pytest

from hub.credentials import hash_secret
from keys.models import KEY_PREFIX, ApiKey

pytestmark = pytest.mark.django_db


def test_an_issued_key_is_stored_only_as_its_hash_and_prefix():
    api_key, plaintext = ApiKey.issue("hashed")
    assert plaintext.startswith(KEY_PREFIX) and len(plaintext) > len(KEY_PREFIX) + 32
    api_key.refresh_from_db()
    assert api_key.key_hash == hash_secret(plaintext) != plaintext
    assert api_key.prefix == plaintext[: len(KEY_PREFIX) + 6]
