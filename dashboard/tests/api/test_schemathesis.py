"""schemathesis, every check, against /api/v1/schema on the live app (in-process WSGI) with a staff token.

The schema comes from the serializers that answer, so any disagreement between
what the API says and what it does fails here. Deterministic and bounded
(25 examples per operation) so it runs in the normal suite.
"""

import time
import tomllib
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import pytest
import schemathesis
from django.conf import settings as django_settings
from django.contrib.auth import get_user_model
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from rest_framework.authtoken.models import Token
from schemathesis import GenerationMode
from schemathesis.config import SchemathesisConfig

from catalog.models import Adapter, Alias
from dashboard.summary import cluster_summary
from dashboard.tests.test_stoppable_surfaces import idle_fleet
from keys.models import ApiKey, Budget
from reconciler.choices import AdapterLoadState, ReplicaState
from reconciler.models import AdapterLoad, Lease
from teams.models import Membership, Team
from tests.fleet import make_model, make_node, make_replica, watch_usage

# The checks' settings are the CLI's (schemathesis.toml): only the model writes, the plan, a new key and the budget
# writes may refuse a schema-valid body, for the rules their 400 documents; here 25 examples per operation.
CONFIG = tomllib.loads((Path(__file__).resolve().parents[3] / "schemathesis.toml").read_text())


@pytest.fixture
def api_schema(db):
    user = get_user_model().objects.create_user("fuzzer", password="pw", is_staff=True)
    token = Token.objects.create(user=user).key
    # A fleet where every part of the status answer has content: a leader, a replica that can be
    # stopped, an unplaceable model, a failed replica with its reason, a key with scopes and usage, budgets.
    Lease.objects.create(name=django_settings.LLMGW_LEASE_NAME, owner="cp-1", epoch=3, expires_at=time.time() + 30)
    watch_usage(known_since=timezone.now() - timedelta(days=1))
    idle_fleet()
    model = make_model("fuzz-model", gpus_per_node=1, min_replicas=0)
    Alias.objects.create(model=model, name="fuzz-alias")
    make_replica(model.profiles.get(), placement=[(make_node("fuzz-node", gpus=2), [0])])
    make_replica(model.profiles.get(), state=ReplicaState.FAILED, error="engine exited: CUDA out of memory")
    ApiKey.issue("fuzz-key", allowed_models=["fuzz-model"], rpm=60)
    budgets(user)
    lora_replica(make_node("fuzz-lora-node", gpus=1))
    summary = cluster_summary().as_json()
    assert summary["leader"] and summary["stoppable"] and summary["unplaceable"], "the fleet lost its variety"
    assert any(m["adapters"]["loaded"] for m in summary["models"]), "the fleet lost its LoRA adapters"
    # The app runs in this thread on the test's own connection; like Django's test client, keep it open.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    config = SchemathesisConfig.from_dict({**CONFIG, "headers": {"Authorization": f"Bearer {token}"}})
    yield schemathesis.openapi.from_wsgi(
        "/api/v1/schema", get_wsgi_application(), config=config, headers={"Authorization": f"Bearer {token}"}
    )
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def budgets(member):
    """A team with a member and a key, and a budget of each scope: the team's, the member's, the key's."""
    team = Team.objects.create(name="fuzz-team")
    Membership.objects.create(team=team, user=member, role=Membership.Role.ADMIN)
    key, _ = ApiKey.issue("fuzz-team-key", team=team, user=member)
    Budget.objects.create(team=team, amount=Decimal("100"), soft_limit_percent=80, alert_url="https://alerts.test/")
    Budget.objects.create(team=team, user=member, amount=Decimal("10"), window=Budget.Window.DAY)
    Budget.objects.create(key=key, amount=Decimal("0.5"), window=Budget.Window.NONE, timezone="Europe/Paris")


def lora_replica(node):
    """A ready replica of a base that takes adapters, with one adapter loaded and one loading."""
    base = make_model("fuzz-base", engine="vllm", sleep_level=0, max_adapters=2, max_adapter_rank=16, min_replicas=0)
    replica = make_replica(base.profiles.get(), placement=[(node, [0])])
    now = timezone.now()
    for name, state in (("fuzz-lora", AdapterLoadState.LOADED), ("fuzz-lora-2", AdapterLoadState.LOADING)):
        adapter = Adapter.objects.create(name=name, base=base, source=f"org/{name}")
        AdapterLoad.objects.create(adapter=adapter, replica=replica, state=state, requested_at=now, loaded_at=now)


# About a minute for the negative examples alone on 2 quiet cores: more than the suite's default timeout allows
# on a busy machine.
@pytest.mark.timeout(360)
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_api_conforms_to_its_schema(api_schema, mode):
    # schemathesis's own pytest plugin does not run under this pytest (9.x); its strategies do.
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) > 20
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=25, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
        def conforms(case):
            case.call_and_validate()

        try:
            conforms()
        except Unsatisfiable:
            # Nothing in this operation can be made invalid (e.g. a bare string path parameter).
            assert mode is GenerationMode.NEGATIVE, operation.label
