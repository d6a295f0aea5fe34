"""The demo fleet `manage.py up --demo` creates: an admin, an API key, a catalog (a file), three nodes.

Everything runs the bundled mock engine, so the demo needs no GPU; the nodes
claim GPUs with the agent's --fake-gpus shapes.
"""

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import transaction

from catalog.as_code import Plan, apply_catalog
from catalog.catalog_file import load_catalog_text
from hub.credentials import hash_secret, new_secret
from inventory.models import NodeCredential
from inventory.services import enrol_node
from keys.models import KEY_PREFIX, ApiKey

DEMO_KEY_NAME = "demo (up --demo)"

# The demo catalog, in the format of `manage.py catalog export`.
DEMO_CATALOG = Path(__file__).with_name("demo_catalog.yaml")

# The first run's admin password and API key, reused by later runs so a copied curl line keeps working.
CREDENTIALS_FILE = "demo-credentials.json"

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
    credentials: str = "new"  # "new", "reused" (from the credentials file) or "from the environment"


class DemoCredentialsError(ValueError):
    """The kept demo credentials file cannot be read; nothing was changed."""


def demo_credentials(var_dir: Path) -> tuple[str, str, str]:
    """(admin password, API key, where they came from): the environment's, else the kept ones, else new.

    New ones are written to `var_dir`/demo-credentials.json (mode 0600) so the next
    run reuses them; LLMGW_DEMO_ADMIN_PASSWORD / LLMGW_DEMO_API_KEY override either.
    """
    path = var_dir / CREDENTIALS_FILE
    kept: dict[str, str] = {}
    if path.exists():
        try:
            kept = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(kept.get("admin_password"), str) or not isinstance(kept.get("api_key"), str):
                raise ValueError("expected an object with the strings admin_password and api_key")
        except (OSError, ValueError) as exc:
            raise DemoCredentialsError(
                f"{path}: cannot reuse the demo credentials ({exc}); delete the file to get new ones"
            ) from None
    password_env, key_env = os.environ.get("LLMGW_DEMO_ADMIN_PASSWORD"), os.environ.get("LLMGW_DEMO_API_KEY")
    if not kept:
        kept = {"admin_password": secrets.token_urlsafe(9), "api_key": new_secret(KEY_PREFIX)}
        var_dir.mkdir(parents=True, exist_ok=True)
        # Created 0600 from the start: the file holds an admin password.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(kept, out)
        origin = "new"
    else:
        origin = "reused"
    if password_env or key_env:
        origin = "from the environment"
    return password_env or kept["admin_password"], key_env or kept["api_key"], origin


@transaction.atomic
def create_demo_fleet(address: str = "127.0.0.1", catalog_text: str | None = None) -> DemoFleet:
    """Create (or refresh, when run again) the demo's admin, key, catalog and nodes.

    `catalog_text`: a catalog file's YAML to apply instead of the bundled one
    (models it does not list are kept). Raises CatalogFileError, before
    anything is written, when it has problems.
    """
    # First, so a bad file changes nothing at all.
    plan = apply_catalog(load_catalog_text(catalog_text or DEMO_CATALOG.read_text(encoding="utf-8")))
    password, key, origin = demo_credentials(Path(settings.VAR_DIR))
    user, _ = get_user_model().objects.get_or_create(username="admin", defaults={"is_staff": True})
    user.is_staff = user.is_superuser = True
    user.set_password(password)
    user.save()

    # The same key as last run keeps its row (and its usage); another one replaces it.
    kept_row = ApiKey.objects.filter(name=DEMO_KEY_NAME, key_hash=hash_secret(key))
    if not kept_row.update(active=True):
        ApiKey.objects.filter(name=DEMO_KEY_NAME).delete()
        ApiKey.objects.filter(key_hash=hash_secret(key)).delete()
        ApiKey.issue(DEMO_KEY_NAME, key)

    nodes = []
    for name, fabric, fake_gpus in NODES:
        # Tokens are stored hashed, so a re-run issues the demo nodes new ones.
        NodeCredential.objects.filter(node__name=name).delete()
        _, token = enrol_node(name, address=address, fabric=fabric)
        nodes.append(DemoNode(name, fabric, fake_gpus, token))
    return DemoFleet("admin", password, key, nodes, plan, origin)
