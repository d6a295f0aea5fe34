"""The demo fleet `manage.py up --demo` creates: an admin, an API key, a catalog (a file), three nodes.

Everything runs the bundled mock engine, so the demo needs no GPU; the nodes
claim GPUs with the agent's --fake-gpus shapes.
"""

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from django.contrib.auth import get_user_model
from django.db import transaction

from catalog.as_code import Plan, apply_catalog
from catalog.catalog_file import load_catalog_text
from hub.credentials import hash_secret
from inventory.models import NodeCredential
from inventory.services import enrol_node
from router.models import ApiKey

DEMO_KEY_NAME = "demo (up --demo)"

# The demo catalog, in the format of `manage.py catalog export`.
DEMO_CATALOG = Path(__file__).with_name("demo_catalog.yaml")

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
    """What the demo printed: the admin login, the API key, the nodes and what its catalog file did."""

    admin_user: str
    admin_password: str
    api_key: str
    nodes: list[DemoNode]
    catalog: Plan


@transaction.atomic
def create_demo_fleet(address: str = "127.0.0.1", catalog_text: str | None = None) -> DemoFleet:
    """Create (or refresh, when run again) the demo's admin, key, catalog and nodes.

    `catalog_text`: a catalog file's YAML to apply instead of the bundled one
    (models it does not list are kept). Raises CatalogFileError, before
    anything is written, when it has problems.
    """
    # First, so a bad file changes nothing at all.
    plan = apply_catalog(load_catalog_text(catalog_text or DEMO_CATALOG.read_text(encoding="utf-8")))
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

    nodes = []
    for name, fabric, fake_gpus in NODES:
        # Tokens are stored hashed, so a re-run issues the demo nodes new ones.
        NodeCredential.objects.filter(node__name=name).delete()
        _, token = enrol_node(name, address=address, fabric=fabric)
        nodes.append(DemoNode(name, fabric, fake_gpus, token))
    return DemoFleet("admin", password, key, nodes, plan)
