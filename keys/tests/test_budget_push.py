"""Budget changes reach every router within a second: saving or deleting a budget publishes the hashes of the keys
it applies to (a key's budget its key, a member's their keys in the team, a team's every key of the team), read in
one query, and of the keys it applied to before a save moved it; a router that cached a key refuses it by its new
budget at once."""

from decimal import Decimal

import pytest
import redis
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext

from conftest import wait_until
from hub import InProcessHub, RedisHub, get_hub
from keys.models import ApiKey, Budget
from router.tests.conftest import MODEL, chat_with_key, make_table
from teams.models import Membership, Team


@pytest.fixture
def published(monkeypatch):
    """The lists of key hashes published through the settings' hub, in order."""
    heard: list[list[str]] = []
    monkeypatch.setattr(get_hub(), "publish_key_changes", heard.append)
    return heard


@pytest.fixture
def org(db):
    """Team search with ana (two keys) and bo (one), team ads with ana's third key, and a key of no team."""
    search, ads = Team.objects.create(name="search"), Team.objects.create(name="ads")
    ana, bo = User.objects.create_user("ana"), User.objects.create_user("bo")
    for team, user in ((search, ana), (search, bo), (ads, ana)):
        Membership.objects.create(team=team, user=user)
    keys = {
        name: ApiKey.issue(name, team=team, user=user)[0]
        for name, team, user in (
            ("ana-1", search, ana),
            ("ana-2", search, ana),
            ("bo-1", search, bo),
            ("ana-ads", ads, ana),
            ("loose", None, None),
        )
    }
    return {"search": search, "ads": ads, "ana": ana, "bo": bo, **keys}


def digests(org, *names: str) -> list[str]:
    return sorted(org[name].key_hash for name in names)


def changed(published) -> list[str]:
    """The hashes published since the last call, sorted."""
    heard = sorted(digest for batch in published for digest in batch)
    published.clear()
    return heard


def save(budget: Budget, capture) -> Budget:
    with capture(execute=True):
        budget.save()
    return budget


def test_a_keys_budget_publishes_that_key(org, published, django_capture_on_commit_callbacks):
    save(Budget(key=org["ana-1"], amount=Decimal(5)), django_capture_on_commit_callbacks)
    assert changed(published) == digests(org, "ana-1")


def test_a_members_budget_publishes_their_keys_of_that_team_only(org, published, django_capture_on_commit_callbacks):
    save(Budget(team=org["search"], user=org["ana"], amount=Decimal(5)), django_capture_on_commit_callbacks)
    assert changed(published) == digests(org, "ana-1", "ana-2")  # not bo's, not hers in ads


def test_a_teams_budget_publishes_every_key_of_the_team(org, published, django_capture_on_commit_callbacks):
    save(Budget(team=org["search"], amount=Decimal(5)), django_capture_on_commit_callbacks)
    assert changed(published) == digests(org, "ana-1", "ana-2", "bo-1")


def test_a_changed_or_deleted_budget_publishes_the_keys_it_applies_to(
    org, published, django_capture_on_commit_callbacks
):
    budget = save(Budget(team=org["ads"], amount=Decimal(5)), django_capture_on_commit_callbacks)
    published.clear()
    budget.amount = Decimal(1)
    save(budget, django_capture_on_commit_callbacks)
    assert changed(published) == digests(org, "ana-ads")
    with django_capture_on_commit_callbacks(execute=True):
        budget.delete()
    assert changed(published) == digests(org, "ana-ads")


def test_a_budget_moved_to_another_scope_publishes_the_keys_it_left_too(
    org, published, django_capture_on_commit_callbacks
):
    budget = save(Budget(team=org["search"], user=org["bo"], amount=Decimal(5)), django_capture_on_commit_callbacks)
    published.clear()
    budget.team, budget.user = None, None
    budget.key = org["loose"]
    save(budget, django_capture_on_commit_callbacks)
    assert changed(published) == digests(org, "bo-1", "loose")  # bo's key no longer has it


def test_nothing_is_published_before_the_transaction_commits(org, published, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        Budget.objects.create(team=org["search"], amount=Decimal(5))
    assert published == [] and len(callbacks) == 1


def test_the_keys_of_a_budget_are_read_in_one_query_however_many_they_are(
    org, published, django_capture_on_commit_callbacks
):
    for i in range(20):
        ApiKey.issue(f"more-{i}", team=org["search"])
    with CaptureQueriesContext(connection) as queries:
        save(Budget(team=org["search"], amount=Decimal(5)), django_capture_on_commit_callbacks)
    reads = [query["sql"] for query in queries if "keys_apikey" in query["sql"]]
    assert len(reads) == 1, reads
    assert len(changed(published)) == 23


# 2 and 10 per million tokens, in spend units per token: a chat's worst case costs more than a budget of 0.
PRICED = {MODEL: {"aliases": [], "price_input": 2 * 10**6, "price_output": 10 * 10**6, "output_bound": 100}}


@pytest.fixture(params=["in-process", "redis"])
def router(request, start_router, start_engine):
    """A router on the settings' hub (with Redis, a client of its own, as another process would have)."""
    if request.param == "redis":
        url = request.getfixturevalue("redis_settings")
        router_hub: RedisHub | InProcessHub = RedisHub(url)
        listeners = redis.Redis.from_url(url)

        def subscribed():
            return listeners.pubsub_numsub(router_hub.key_changes_channel)[0][1] >= 1
    else:
        router_hub = get_hub()

        def subscribed():
            return len(get_hub()._key_watchers) >= 1

    get_hub().publish_endpoints(make_table([start_engine().url], models=PRICED))
    server = start_router(router_hub)
    wait_until(subscribed, timeout=5)
    return server


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("scope", ["key", "member", "team"])
def test_a_budget_set_on_a_cached_key_refuses_it_within_a_second(router, scope):
    team = Team.objects.create(name="search")
    ana = User.objects.create_user("ana")
    Membership.objects.create(team=team, user=ana)
    api_key, key = ApiKey.issue("cached", team=team, user=ana)
    assert chat_with_key(router, key).status_code == 200  # cached now (30 s TTL), with no budget
    scopes = {"key": {"key": api_key}, "member": {"team": team, "user": ana}, "team": {"team": team}}
    Budget.objects.create(amount=Decimal(0), **scopes[scope])
    wait_until(lambda: chat_with_key(router, key).status_code == 429, timeout=1.0)
    assert chat_with_key(router, key).json()["error"]["code"] == "budget_exceeded"
