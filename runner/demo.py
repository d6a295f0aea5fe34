"""The demo fleet `manage.py up --demo` creates: an admin, an API key, a catalog, three nodes.

Everything runs the bundled mock engine, so the demo needs no GPU; the nodes
claim GPUs with the agent's --fake-gpus shapes.
"""

import os
import secrets
from dataclasses import dataclass

from django.contrib.auth import get_user_model
from django.db import transaction

from catalog.choices import Engine
from catalog.models import Alias, Model, Profile
from hub.credentials import hash_secret
from inventory.models import NodeCredential
from inventory.services import enrol_node
from router.models import ApiKey

DEMO_KEY_NAME = "demo (up --demo)"

# (name, aliases, source, profile fields)
CATALOG = [
    (
        "llama-3.1-8b-instruct",
        ["llama3"],
        "meta-llama/Llama-3.1-8B-Instruct",
        {"gpu_class": "H100-80GB", "gpus_per_node": 1, "max_replicas": 2, "idle_timeout_seconds": 900},
    ),
    (
        "qwen2.5-7b-instruct",
        ["qwen"],
        "Qwen/Qwen2.5-7B-Instruct",
        {"gpu_class": "L40S-48GB", "gpus_per_node": 1, "max_replicas": 1, "idle_timeout_seconds": 900},
    ),
    (
        "llama-3.1-70b-instruct",
        [],
        "meta-llama/Llama-3.1-70B-Instruct",
        {"gpu_class": "H100-80GB", "gpus_per_node": 4, "max_replicas": 1, "priority": 10},
    ),
    (
        "bge-m3",
        ["embeddings"],
        "BAAI/bge-m3",
        {"gpu_class": "L40S-48GB", "gpus_per_node": 1, "min_replicas": 1, "max_replicas": 1},
    ),
]

# (name, fabric, fake GPUs)
NODES = [
    ("gpu-a", "ib-a", "8xH100-80GB"),
    ("gpu-b", "ib-a", "8xH100-80GB"),
    ("gpu-c", "", "4xL40S-48GB"),
]


@dataclass
class DemoNode:
    """A simulated node and the credential its in-process agent uses."""

    name: str
    fabric: str
    fake_gpus: str
    token: str


@dataclass
class DemoFleet:
    """What the demo printed: the admin login, the API key and the nodes."""

    admin_user: str
    admin_password: str
    api_key: str
    nodes: list[DemoNode]


@transaction.atomic
def create_demo_fleet(address: str = "127.0.0.1") -> DemoFleet:
    """Create (or refresh, when run again) the demo's admin, key, catalog and nodes."""
    password = os.environ.get("LLMGW_DEMO_ADMIN_PASSWORD") or secrets.token_urlsafe(9)
    user, _ = get_user_model().objects.get_or_create(username="admin", defaults={"is_staff": True})
    user.is_staff = user.is_superuser = True
    user.set_password(password)
    user.save()

    key = os.environ.get("LLMGW_DEMO_API_KEY")
    # A fresh key each run (or the fixed one again); the previous run's key, never shown again, goes.
    ApiKey.objects.filter(name=DEMO_KEY_NAME).delete()
    if key:
        ApiKey.objects.filter(key_hash=hash_secret(key)).delete()
    _, key = ApiKey.issue(DEMO_KEY_NAME, key)

    for name, aliases, source, profile in CATALOG:
        model, created = Model.objects.get_or_create(name=name, defaults={"source": source})
        if created:
            Profile.objects.create(model=model, engine=Engine.MOCK, **profile)
            Alias.objects.bulk_create([Alias(model=model, name=alias) for alias in aliases])

    nodes = []
    for name, fabric, fake_gpus in NODES:
        # Tokens are stored hashed, so a re-run issues the demo nodes new ones.
        NodeCredential.objects.filter(node__name=name).delete()
        _, token = enrol_node(name, address=address, fabric=fabric)
        nodes.append(DemoNode(name, fabric, fake_gpus, token))
    return DemoFleet("admin", password, key, nodes)
