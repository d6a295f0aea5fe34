"""`create_api_key` and `enrol_node`: print the secret once, refuse bad input without writing anything."""

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from hub.credentials import hash_secret
from inventory.models import Node, NodeCredential
from keys.models import ApiKey

pytestmark = pytest.mark.django_db


def run(name, *args):
    out, err = StringIO(), StringIO()
    call_command(name, *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_create_api_key_prints_only_the_key_and_stores_its_hash():
    out, err = run("create_api_key", "team-a")
    key = out.strip()
    assert out == key + "\n" and key.startswith("sk-llmgw-")
    assert "will not be shown again" in err and key not in err
    api_key = ApiKey.objects.get()
    assert (api_key.name, api_key.key_hash, api_key.active) == ("team-a", hash_secret(key), True)


@pytest.mark.parametrize("name", ["", "   "])
def test_create_api_key_refuses_a_blank_name(name):
    with pytest.raises(CommandError, match="must not be empty"):
        run("create_api_key", name)
    assert not ApiKey.objects.exists()


def test_create_api_key_refuses_a_too_long_name():
    with pytest.raises(CommandError, match="at most 100"):
        run("create_api_key", "x" * 101)
    assert not ApiKey.objects.exists()


def test_enrol_node_prints_the_token_once_and_stores_its_hash():
    out, err = run("enrol_node", "gpu-a", "--address", "10.0.0.5", "--fabric", "ib-a")
    token = out.strip()
    assert out == token + "\n" and token.startswith("llmgw-node-")
    assert "will not be shown again" in err and token not in err
    node = Node.objects.get()
    assert (node.name, node.address, node.fabric) == ("gpu-a", "10.0.0.5", "ib-a")
    assert NodeCredential.objects.verify("gpu-a", token) is not None


def test_enrol_node_refuses_a_bad_name_and_writes_nothing():
    with pytest.raises(CommandError, match="name: Use letters, digits"):
        run("enrol_node", "bad name!")
    assert not Node.objects.exists() and not NodeCredential.objects.exists()


def test_enrol_node_refuses_a_node_already_enrolled():
    token, _ = run("enrol_node", "gpu-a")
    with pytest.raises(CommandError, match="already enrolled"):
        run("enrol_node", "gpu-a", "--fabric", "ib-b")
    assert NodeCredential.objects.count() == 1
    assert NodeCredential.objects.verify("gpu-a", token.strip()) is not None
    assert Node.objects.get().fabric == ""
