"""Teams bound their keys: a request must fit the key's scope and its team's (at every router, within a second
of a change), a key is held by a member of its team and names none of the team's models beyond it, a member who
leaves keeps none of the team's keys, and a team holding keys is not deleted."""

from decimal import Decimal

import httpx
import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import connection
from django.db.models import ProtectedError
from django.test.utils import CaptureQueriesContext

from conftest import wait_until
from hub import get_hub
from hub.credentials import hash_secret
from keys.models import ApiKey, Budget
from router.key_cache import find_active_key
from router.tests.conftest import MODEL, chat_with_key, make_table
from teams.models import Membership, Team

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def router(start_router, start_engine):
    get_hub().publish_endpoints(make_table([start_engine().url]))
    return start_router(get_hub())


def member(team: Team, name: str, role: str = Membership.Role.MEMBER) -> User:
    user = User.objects.create_user(name)
    Membership.objects.create(team=team, user=user, role=role)
    return user


def test_a_request_must_fit_the_teams_scope_as_well_as_the_keys(router):
    team = Team.objects.create(name="search", allowed_models=["another-model"])
    _, key = ApiKey.issue("search bot", team=team, user=member(team, "ana"))
    _, own = ApiKey.issue("no team")

    refused = chat_with_key(router, key)
    assert refused.status_code == 403
    assert refused.json()["error"]["message"] == (
        f"The API key “search bot” may not use the model `{MODEL}` (its team's models do not include it)."
    )
    assert chat_with_key(router, own).status_code == 200  # a key of no team keeps working as before

    team.allowed_models = [MODEL]
    team.save()  # every router reads the team's keys again
    wait_until(lambda: chat_with_key(router, key).status_code == 200, timeout=1)


def test_a_key_narrower_than_its_team_is_refused_as_the_keys_own_scope(router):
    team = Team.objects.create(name="search", allowed_models=[MODEL, "another-model"])
    _, key = ApiKey.issue("narrow", team=team, allowed_models=["another-model"])
    refused = chat_with_key(router, key)
    assert refused.status_code == 403
    assert refused.json()["error"]["message"] == f"The API key “narrow” may not use the model `{MODEL}`."


def test_the_model_list_a_key_gets_is_its_teams_too(router):
    team = Team.objects.create(name="search", allowed_models=["another-model"])
    _, key = ApiKey.issue("lister", team=team)
    _, own = ApiKey.issue("no team")
    listed = httpx.get(f"{router.url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    everything = httpx.get(f"{router.url}/v1/models", headers={"Authorization": f"Bearer {own}"}, timeout=10)
    assert listed.json()["data"] == [] and MODEL in [m["id"] for m in everything.json()["data"]]


def test_a_key_and_its_team_are_read_in_one_query_and_its_budgets_in_another():
    team = Team.objects.create(name="search", allowed_models=[MODEL])
    holder = member(team, "ana")
    row, key = ApiKey.issue("two queries", team=team, user=holder)
    Budget.objects.create(team=team, amount=Decimal("5"), window="month")
    Budget.objects.create(team=team, user=holder, amount=Decimal("2"), window="day", timezone="Europe/Paris")
    Budget.objects.create(key=row, amount=Decimal("1"), window="none")
    Budget.objects.create(team=Team.objects.create(name="other"), amount=Decimal("9"), window="day")  # not its
    with CaptureQueriesContext(connection) as queries:
        info = find_active_key(hash_secret(key))
    assert len(queries) == 2
    assert info is not None and info.team_models == frozenset({MODEL}) and info.team_id == team.pk
    # Its own first, then its holder's in the team, then the team's: the order a refusal names them in.
    assert [(rule.scope, rule.window, rule.limit) for rule in info.budgets] == [
        ("key “two queries”", "none", 10**12),
        ("ana in team “search”", "day", 2 * 10**12),
        ("team “search”", "month", 5 * 10**12),
    ]


def test_a_teams_key_is_held_by_a_member_and_names_none_of_the_models_beyond_the_team():
    team = Team.objects.create(name="search", allowed_models=[MODEL])
    outsider = User.objects.create_user("bo")
    with pytest.raises(ValidationError) as not_member:
        ApiKey(name="k", team=team, user=outsider).full_clean(exclude=["prefix", "key_hash"])
    assert not_member.value.message_dict["user"] == ["bo is not a member of the team “search”."]

    wider = ApiKey(name="k", team=team, user=member(team, "ana"), allowed_models=[MODEL, "qwen", "phi"])
    with pytest.raises(ValidationError) as widened:
        wider.full_clean(exclude=["prefix", "key_hash"])
    assert widened.value.message_dict["allowed_models"] == [
        f"the team “search” may not use `qwen`, `phi`: a key's models are its team's or fewer ({MODEL})."
    ]
    ApiKey(name="k", team=team, user=wider.user, allowed_models=[MODEL]).full_clean(exclude=["prefix", "key_hash"])


def test_a_member_who_leaves_has_their_keys_of_the_team_revoked_and_no_other(router):
    team, other = Team.objects.create(name="search"), Team.objects.create(name="ads")
    ana = member(team, "ana")
    Membership.objects.create(team=other, user=ana)
    _, team_key = ApiKey.issue("ana's search key", team=team, user=ana)
    _, other_key = ApiKey.issue("ana's ads key", team=other, user=ana)
    _, colleague_key = ApiKey.issue("bo's search key", team=team, user=member(team, "bo"))
    assert chat_with_key(router, team_key).status_code == 200  # cached by the router now

    Membership.objects.get(team=team, user=ana).delete()

    wait_until(lambda: chat_with_key(router, team_key).status_code == 401, timeout=1)
    assert chat_with_key(router, other_key).status_code == 200
    assert chat_with_key(router, colleague_key).status_code == 200
    assert list(ApiKey.objects.filter(active=False).values_list("name", flat=True)) == ["ana's search key"]


def test_a_team_holding_keys_is_not_deleted():
    team = Team.objects.create(name="search")
    ApiKey.issue("kept", team=team)
    with pytest.raises(ProtectedError):
        team.delete()
    assert Team.objects.filter(name="search").exists()
