"""The self-service pages under /me/, through Django's test client, per role: an operator, a team's admin, a member
of that team, and a member of another team. What each sees and may do on each page; that nothing of another team
ever shows; that a new key is shown once, in the answer to its POST only; that every write is a POST with its CSRF
token; and that each page runs the same number of queries whatever the number of keys, members, budgets and rows."""

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

import pytest
from django.contrib.auth.models import User
from django.contrib.sessions.models import Session
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from redis import RedisError

from conftest import wait_until
from dashboard.tests.teams.conftest import hold
from hub import get_hub
from hub.credentials import hash_secret
from keys.models import ApiKey, Budget, GpuHour, ReplicaTokens, TokenUsage
from router.tests.conftest import MODEL, chat_with_key, make_table
from teams.models import Membership, Team
from teams.usage_report import OTHER, usage_report
from tests.fleet import make_model

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 3, 14, 9, 30, tzinfo=UTC)
TODAY = datetime(2026, 3, 14, tzinfo=UTC)
ME = "/me/"


@pytest.fixture(autouse=True)
def frozen(monkeypatch):
    """The pages are made at NOW: the usage window and the budgets' windows are the same whenever the tests run."""
    monkeypatch.setattr("teams.views.timezone", SimpleNamespace(now=lambda: NOW))


def spent(key: ApiKey, hour: datetime, amount: str = "0", model: str = "tiny-llama", tokens: int = 100) -> TokenUsage:
    """An hourly row of `key` on `model`, as the routers store them (with the key's team and holder)."""
    return TokenUsage.objects.create(
        key=key, key_name=key.name, model=model, hour=hour, requests=1, prompt_tokens=tokens, completion_tokens=tokens,
        team=key.team, user=key.user, spend_units=int(Decimal(amount).scaleb(12)),
    )  # fmt: skip


@dataclass
class World:
    """Two teams. “ml” (models tiny-llama and tiny-qwen): ada its admin, bob a member. “search”: eve a member. An operator,
    ops, in no team. Each has a key (bob a second one), spend on it, and budgets of each scope."""

    ml: Team
    search: Team
    ops: User
    ada: User
    bob: User
    eve: User
    adas: ApiKey
    bobs: ApiKey
    eves: ApiKey
    opss: ApiKey


def login(client: Client, user: User) -> Client:
    client.force_login(user)
    return client


@pytest.fixture
def world() -> World:
    ml = Team.objects.create(name="ml", allowed_models=["tiny-llama", "tiny-qwen"])
    search = Team.objects.create(name="search")
    ops = User.objects.create_user("ops", password="pw", is_staff=True)
    ada, bob, eve = (User.objects.create_user(name, password="pw") for name in ("ada", "bob", "eve"))
    Membership.objects.create(team=ml, user=ada, role=Membership.Role.ADMIN)
    Membership.objects.create(team=ml, user=bob)
    Membership.objects.create(team=search, user=eve)
    adas = ApiKey.issue("ada-key", team=ml, user=ada)[0]
    bobs = ApiKey.issue("bob-key", team=ml, user=bob, allowed_models=["tiny-qwen"])[0]
    ApiKey.issue("bob-old-key", team=ml, user=bob, active=False)
    eves = ApiKey.issue("eve-key", team=search, user=eve)[0]
    opss = ApiKey.issue("ops-key", user=ops)[0]
    spent(adas, TODAY + timedelta(hours=9), "1.5")
    spent(bobs, TODAY + timedelta(hours=8), "0.25", model="tiny-qwen")
    spent(bobs, TODAY + timedelta(hours=9), "0.5", model="tiny-qwen")
    spent(bobs, TODAY - timedelta(days=3), "2", model="tiny-qwen")
    spent(bobs, TODAY - timedelta(days=30), "100", model="tiny-qwen")  # before the 30 days
    spent(eves, TODAY, "7", model="secret-model")
    spent(opss, TODAY, "9", model="ops-model")
    Budget.objects.create(team=ml, amount=Decimal(10), window="day", timezone="Europe/Paris")
    Budget.objects.create(team=ml, user=ada, amount=Decimal(3), window="week")
    Budget.objects.create(key=bobs, amount=Decimal(5), window="month")
    Budget.objects.create(team=search, amount=Decimal(77), window="month")
    Budget.objects.create(team=search, user=eve, amount=Decimal(66), window="day")
    # A replica's hour this morning, shared 3:1 by ada's key and eve's (keys.showback); one of last month, ml's.
    for hour, tokens in ((TODAY + timedelta(hours=8), {adas: 300, eves: 100}), (TODAY - timedelta(days=14), {adas: 1})):
        GpuHour.objects.create(replica_id=1, model="tiny-llama", hour=hour, gpu_seconds=3600)
        for key, count in tokens.items():
            ReplicaTokens.objects.create(replica_id=1, hour=hour, key=key, team=key.team, tokens=count)
    return World(ml, search, ops, ada, bob, eve, adas, bobs, eves, opss)


def page(client: Client, url: str = ME) -> str:
    response = client.get(url)
    assert response.status_code == 200, response.status_code
    return response.content.decode()


def mentions(html: str, word: str) -> bool:
    """Whether the page names `word` as a word (“eve”, not the end of “never”)."""
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", html) is not None


def section(html: str, name: str) -> str:
    """The text of the page's <section id=name>."""
    found = re.search(rf'<section id="{name}">(.*?)</section>', html, re.S)
    assert found, f"no section {name}"
    return found.group(1)


# --- signing in -----------------------------------------------------------------------------------------------------


def test_every_page_and_write_sends_an_anonymous_visitor_to_log_in(client, world):
    for url in (ME, f"/me/teams/{world.ml.pk}/"):
        response = client.get(url)
        assert (response.status_code, response["Location"]) == (302, f"/me/login?next={url}")
    revoke = client.post(f"/me/keys/{world.bobs.pk}/revoke")
    assert revoke.status_code == 302 and revoke["Location"].startswith("/me/login")
    assert ApiKey.objects.get(pk=world.bobs.pk).active


def test_a_member_logs_in_at_me_login_and_out_with_a_post(client, world):
    assert "Log in" in page(client, "/me/login")
    refused = client.post("/me/login", {"username": "bob", "password": "wrong"})
    assert refused.status_code == 200 and "Please enter a correct username and password" in refused.content.decode()

    signed = client.post("/me/login", {"username": "bob", "password": "pw"})
    assert (signed.status_code, signed["Location"]) == (302, ME)
    assert "Hello, bob" in page(client)
    assert client.get("/me/logout").status_code == 405  # logging out is a POST, with its CSRF token

    out = client.post("/me/logout")
    assert (out.status_code, out["Location"]) == (302, "/me/login")
    assert client.get(ME).status_code == 302


def test_writes_need_their_csrf_token(world):
    strict = login(Client(enforce_csrf_checks=True), world.bob)
    assert strict.post(f"/me/keys/{world.bobs.pk}/revoke").status_code == 403
    assert strict.post(ME, {"name": "x", "team": world.ml.pk}).status_code == 403
    assert ApiKey.objects.get(pk=world.bobs.pk).active and not ApiKey.objects.filter(name="x").exists()


# --- what each role sees ----------------------------------------------------------------------------------------------


def test_a_member_sees_their_teams_keys_usage_and_budgets_and_nothing_of_anyone_elses(client, world):
    html = page(login(client, world.bob))
    assert re.findall(r'<tr class="team-row"><td>(.*?)</td><td>(.*?)</td>', html) == [("ml", "member")]
    assert "manage the team" not in html
    keys = section(html, "keys")
    assert re.findall(r'<tr class="key-row" id="key-\d+">\s*<td>(.*?)</td>', keys) == ["bob-old-key", "bob-key"]
    assert keys.count('name="revoke"') == 1  # the revoked key has no button
    assert "state-revoked" in keys and world.bobs.prefix in keys
    usage = section(html, "usage")
    assert re.findall(r'<tr class="usage-row"><td>(.*?)</td><td>(.*?)</td>', usage) == [
        ("2026-03-14", "tiny-qwen"),
        ("2026-03-11", "tiny-qwen"),
    ]
    assert ">0.75<" in usage and ">2.75<" in usage  # today's two hours summed; the 30 days' total
    assert "100.00" not in usage and "102.75" not in usage  # the row before the window is not counted
    budgets = re.findall(r'<tr class="budget-row[^"]*"><td>(.*?)</td>', section(html, "budgets"))
    assert budgets == ["team “ml”", "key “bob-key”"]  # not ada's own budget in the team, nothing of search
    for elsewhere in ("ada-key", "eve-key", "ops-key", "search", "secret-model", "ops-model", "ada in team"):
        assert not mentions(html, elsewhere), elsewhere


def test_a_member_of_another_team_sees_only_that_team(client, world):
    html = page(login(client, world.eve))
    assert re.findall(r'<tr class="team-row"><td>(.*?)</td>', html) == ["search"]
    assert "eve-key" in html and "secret-model" in html
    assert re.findall(r'<tr class="budget-row[^"]*"><td>(.*?)</td>', html) == ["team “search”", "eve in team “search”"]
    for elsewhere in ("ml", "ada-key", "bob-key", "tiny-qwen", "tiny-llama"):
        assert not mentions(html, elsewhere), elsewhere


def test_a_team_admin_manages_their_team_and_sees_nothing_of_another(client, world):
    login(client, world.ada)
    home = page(client)
    assert f'href="/me/teams/{world.ml.pk}/"' in home
    html = page(client, f"/me/teams/{world.ml.pk}/")
    assert re.findall(r'<tr class="member-row" id="member-\d+"><td>(.*?)</td><td>(.*?)</td>', html) == [
        ("ada", "admin"),
        ("bob", "member"),
    ]
    keys = section(html, "keys")
    assert re.findall(r'id="key-\d+">\s*<td>(.*?)</td>\s*<td>.*?</td>\s*<td>(.*?)</td>', keys) == [
        ("bob-old-key", "bob"),
        ("bob-key", "bob"),
        ("ada-key", "ada"),
    ]  # newest first, with their holders
    assert re.findall(r'<tr class="budget-row[^"]*"><td>(.*?)</td>', html) == [
        "team “ml”",
        "ada in team “ml”",
        "key “bob-key”",
    ]
    usage = section(html, "usage")
    assert re.findall(r'<tr class="usage-row"><td>(.*?)</td><td>(.*?)</td>', usage) == [
        ("2026-03-14", "tiny-llama"),
        ("2026-03-14", "tiny-qwen"),
        ("2026-03-11", "tiny-qwen"),
    ]
    # Its showback this month: three quarters of the shared hour; not last month's, nothing of search's.
    showback = section(html, "showback")
    assert re.findall(r'<tr class="showback-row"><td>(.*?)</td><td>(.*?)</td><td>(.*?)</td>', showback) == [
        ("tiny-llama", "0.8", "300")
    ]
    for elsewhere in ("eve", "search", "secret-model", "ops-key", "ops-model"):
        assert not mentions(html, elsewhere), elsewhere
    assert client.get(f"/me/teams/{world.search.pk}/").status_code == 404
    assert client.get("/me/teams/999999/").status_code == 404


def test_a_plain_member_gets_403_for_their_team_and_404_for_another(client, world):
    login(client, world.bob)
    assert client.get(f"/me/teams/{world.ml.pk}/").status_code == 403
    assert client.get(f"/me/teams/{world.search.pk}/").status_code == 404
    assert client.post(f"/me/teams/{world.ml.pk}/", {"username": "eve", "role": "admin"}).status_code == 403
    bobs_membership = Membership.objects.get(user=world.bob)
    assert client.post(f"/me/teams/{world.ml.pk}/members/{bobs_membership.pk}/remove").status_code == 403
    assert client.post(f"/me/teams/{world.ml.pk}/keys/{world.adas.pk}/revoke").status_code == 403
    assert client.post(f"/me/teams/{world.search.pk}/keys/{world.eves.pk}/revoke").status_code == 404
    assert Membership.objects.filter(team=world.ml).count() == 2
    assert not Membership.objects.filter(user=world.eve, team=world.ml).exists()
    assert ApiKey.objects.get(pk=world.adas.pk).active and ApiKey.objects.get(pk=world.eves.pk).active


def test_an_operator_sees_every_team_their_own_keys_and_manages_any_team(client, world):
    login(client, world.ops)
    html = page(client)
    assert re.findall(r'<tr class="team-row"><td>(.*?)</td><td>(.*?)</td>', html) == [
        ("ml", "operator"),
        ("search", "operator"),
    ]
    assert html.count("manage the team") == 2
    assert re.findall(r'id="key-\d+">\s*<td>(.*?)</td>', html) == ["ops-key"]  # their own keys only, here
    assert "ops-model" in html and "secret-model" not in html
    search = page(client, f"/me/teams/{world.search.pk}/")
    assert "eve-key" in search and "ada-key" not in search


# --- keys -------------------------------------------------------------------------------------------------------------


def test_a_new_key_is_shown_once_in_the_answer_to_its_post_and_never_again(client, world):
    login(client, world.bob)
    made = client.post(ME, {"name": "notebook", "team": world.ml.pk, "models": "tiny-llama, tiny-qwen"})
    assert made.status_code == 200
    html = made.content.decode()
    plaintext = re.search(r'<code id="new-key-value">(sk-llmgw-[^<]+)</code>', html).group(1)
    assert "Copy it now: it will not be shown again." in html
    key = ApiKey.objects.get(key_hash=hash_secret(plaintext))
    assert (key.name, key.team, key.user, key.allowed_models) == (
        "notebook",
        world.ml,
        world.bob,
        ["tiny-llama", "tiny-qwen"],
    )
    assert plaintext.startswith(key.prefix) and plaintext != key.prefix
    assert 'value="notebook"' not in html  # the form is empty again
    assert "notebook" in section(html, "keys")

    again = page(client)
    assert plaintext not in again and "new-key-value" not in again and "notebook" in again
    assert not any(plaintext in session.session_data for session in Session.objects.all())
    assert plaintext not in str(client.session.items())


def test_a_key_beyond_the_teams_models_is_refused_next_to_the_models_field(client, world):
    login(client, world.bob)
    refused = client.post(ME, {"name": "wide", "team": world.ml.pk, "models": "tiny-llama, mistral"})
    assert refused.status_code == 400
    form = section(refused.content.decode(), "new-key-form")
    assert re.search(r'name="models".*may not use `mistral`', form, re.S)
    assert "new-key-value" not in refused.content.decode()
    assert not ApiKey.objects.filter(name="wide").exists()


def test_a_key_is_refused_naming_the_field_without_a_team_of_ones_own_or_a_known_model(client, world):
    make_model("tiny-llama")  # the catalog knows tiny-llama (and tiny-qwen is in ml's scope but not the catalog)
    login(client, world.bob)
    cases = [
        ({"name": "k", "team": ""}, "team", "Choose one of your teams: a key belongs to one."),
        ({"name": "k", "team": world.search.pk}, "team", "Choose one of your teams: you are not a member of that one."),
        ({"name": "", "team": world.ml.pk}, "name", "This field is required."),
        ({"name": "k", "team": world.ml.pk, "models": "tiny-qwen"}, "models", "Unknown model `tiny-qwen`"),
    ]
    for data, field, message in cases:
        refused = client.post(ME, data)
        form = section(refused.content.decode(), "new-key-form")
        assert refused.status_code == 400 and re.search(rf'name="{field}".*{re.escape(message)}', form, re.S), data
    assert not ApiKey.objects.filter(name="k").exists()


def test_an_operator_makes_a_key_of_no_team(client, world):
    login(client, world.ops)
    made = client.post(ME, {"name": "ops-tool", "team": ""})
    assert made.status_code == 200 and "new-key-value" in made.content.decode()
    assert ApiKey.objects.filter(name="ops-tool", team=None, user=world.ops).exists()


def test_a_member_revokes_their_own_key_and_no_one_elses(
    client, world, monkeypatch, django_capture_on_commit_callbacks
):
    heard: list[list[str]] = []
    monkeypatch.setattr(get_hub(), "publish_key_changes", heard.append)
    login(client, world.bob)
    with django_capture_on_commit_callbacks(execute=True):
        revoked = client.post(f"/me/keys/{world.bobs.pk}/revoke", follow=True)
    assert "Key “bob-key” revoked: every router refuses it within a second." in revoked.content.decode()
    assert not ApiKey.objects.get(pk=world.bobs.pk).active
    assert heard == [[world.bobs.key_hash]]
    for other in (world.adas, world.eves):
        assert client.post(f"/me/keys/{other.pk}/revoke").status_code == 404
        assert ApiKey.objects.get(pk=other.pk).active
    assert client.get(f"/me/keys/{world.bobs.pk}/revoke").status_code == 405


def test_a_team_admin_revokes_any_key_of_their_team_and_none_of_another(client, world):
    login(client, world.ada)
    done = client.post(f"/me/teams/{world.ml.pk}/keys/{world.bobs.pk}/revoke")
    assert (done.status_code, done["Location"]) == (302, f"/me/teams/{world.ml.pk}/")
    assert not ApiKey.objects.get(pk=world.bobs.pk).active
    assert client.post(f"/me/teams/{world.ml.pk}/keys/{world.eves.pk}/revoke").status_code == 404
    assert client.post(f"/me/teams/{world.search.pk}/keys/{world.eves.pk}/revoke").status_code == 404
    assert ApiKey.objects.get(pk=world.eves.pk).active


# --- members ----------------------------------------------------------------------------------------------------------


def test_a_team_admin_adds_a_member_by_username_with_a_role(client, world):
    login(client, world.ada)
    url = f"/me/teams/{world.ml.pk}/"
    added = client.post(url, {"username": "eve", "role": "admin"}, follow=True)
    assert "eve is now in the team as admin." in added.content.decode()
    assert Membership.objects.get(team=world.ml, user=world.eve).role == "admin"

    for data, message in (
        ({"username": "nobody", "role": "member"}, "No user is called “nobody”: check the spelling"),
        ({"username": "bob", "role": "member"}, "bob is already in the team “ml”."),
        ({"username": "", "role": "member"}, "This field is required."),
        ({"username": "ops", "role": "owner"}, "Select a valid choice. owner is not one of the available choices."),
    ):
        refused = client.post(url, data)
        html = refused.content.decode()
        field = "role" if "owner" in message else "username"
        assert refused.status_code == 400 and re.search(rf'name="{field}".*{re.escape(message)}', html, re.S), data
    assert Membership.objects.filter(team=world.ml).count() == 3


def test_a_team_admin_removes_a_member_whose_team_keys_are_revoked_but_not_the_last_admin(client, world):
    login(client, world.ada)
    url = f"/me/teams/{world.ml.pk}/"
    bobs = Membership.objects.get(team=world.ml, user=world.bob)
    removed = client.post(f"{url}members/{bobs.pk}/remove", follow=True)
    assert "bob left the team; their keys of it are revoked" in removed.content.decode()
    assert not Membership.objects.filter(pk=bobs.pk).exists()
    assert not ApiKey.objects.get(pk=world.bobs.pk).active

    adas = Membership.objects.get(team=world.ml, user=world.ada)
    kept = client.post(f"{url}members/{adas.pk}/remove", follow=True)
    assert "ada is the team&#x27;s last admin: the team needs another first" in kept.content.decode()
    assert Membership.objects.filter(pk=adas.pk).exists()

    cyd = User.objects.create_user("cyd")
    Membership.objects.create(team=world.ml, user=cyd, role=Membership.Role.ADMIN)
    left = client.post(f"{url}members/{adas.pk}/remove")  # another admin now: ada may leave, to her own page
    assert (left.status_code, left["Location"]) == (302, ME)
    assert client.get(url).status_code == 404

    eves = Membership.objects.get(user=world.eve)
    login(client, cyd)
    assert client.post(f"{url}members/{eves.pk}/remove").status_code == 404
    assert client.post(f"/me/teams/{world.search.pk}/members/{eves.pk}/remove").status_code == 404
    assert Membership.objects.filter(pk=eves.pk).exists()


# --- usage and budgets ------------------------------------------------------------------------------------------------


def test_the_usage_chart_is_inline_svg_with_a_bar_per_day_and_model(client, world):
    html = page(login(client, world.ada), f"/me/teams/{world.ml.pk}/")
    svg = re.search(r'<svg class="usage-chart".*?</svg>', html, re.S).group(0)
    titles = re.findall(r'<rect class="bar"[^>]*><title>(.*?)</title>', svg)
    assert titles == [
        "2026-03-11 tiny-qwen: 1 request, 200 tokens, 2.00 spent",
        "2026-03-14 tiny-qwen: 2 requests, 400 tokens, 0.75 spent",  # the most spent model at the bottom of each bar
        "2026-03-14 tiny-llama: 1 request, 200 tokens, 1.50 spent",
    ]
    assert "spend, peak 2.25" in svg
    heights = [float(h) for h in re.findall(r'<rect class="bar"[^>]*height="([\d.]+)"', svg)]
    assert heights[1] + heights[2] == 140  # the tallest day fills the plot
    assert "<script" not in svg and "http://" not in html.replace("http://www.w3.org/2000/svg", "")


def test_without_prices_the_chart_shows_tokens(client, world):
    TokenUsage.objects.update(spend_units=0)
    html = page(login(client, world.bob))
    assert "tokens, peak 400 tokens" in html


def test_no_usage_says_so_and_draws_no_chart(client, world):
    TokenUsage.objects.all().delete()
    html = page(login(client, world.bob))
    assert "No requests since 2026-02-13." in html and "<svg" not in html


def test_models_beyond_the_palette_are_drawn_together_and_each_day_stacks_to_its_share():
    team = Team.objects.create(name="many")
    key = ApiKey.issue("k", team=team)[0]
    for index in range(9):
        spent(key, TODAY, str(index + 1), model=f"m{index}")  # m8 the most spent, m0 the least
    spent(key, TODAY - timedelta(days=1), "22.5", model="m8")

    report = usage_report(TokenUsage.objects.filter(team=team), NOW)

    assert [line.model for line in report.by_model] == [f"m{index}" for index in range(8, -1, -1)]
    assert report.total.spend == "67.50" and report.total.requests == 10
    chart = report.chart
    assert [model for model, _ in chart.legend] == [*(f"m{index}" for index in range(8, 1, -1)), OTHER]
    today = [bar for bar in chart.bars if bar.title.startswith("2026-03-14")]
    assert today[-1].title == "2026-03-14 other models: 2 requests, 400 tokens, 3.00 spent"  # m0 and m1
    assert round(sum(bar.height for bar in today), 2) == 140  # 45 spent today, the peak
    (yesterday,) = [bar for bar in chart.bars if bar.title.startswith("2026-03-13")]
    assert yesterday.height == 70 and yesterday.y == 18 + 70  # half the peak, standing on the baseline


def test_budgets_show_their_use_now_and_when_they_reset_in_their_time_zone(client, world, budget_hub):
    day, member = Budget.objects.get(team=world.ml, window="day"), Budget.objects.get(user=world.ada)
    hold(budget_hub, day, "7.5")
    hold(budget_hub, member, "3")
    html = page(login(client, world.ada), f"/me/teams/{world.ml.pk}/")
    rows = re.findall(r'<tr class="budget-row([^"]*)">' + r"<td[^>]*>(.*?)</td>" * 5, html)
    assert rows == [
        ("", "team “ml”", "10.00", "7.50", "day", "2026-03-15 00:00 CET"),
        (" exhausted", "ada in team “ml”", "3.00", "3.00", "week (from Monday)", "2026-03-16 00:00 UTC"),
        ("", "key “bob-key”", "5.00", "0.00", "month", "2026-04-01 00:00 UTC"),
    ]


def test_budgets_whose_counters_cannot_be_read_show_their_use_unknown(client, world, monkeypatch):
    def unreadable(counters):
        raise RedisError("connection refused")

    monkeypatch.setattr(get_hub(), "budget_use", unreadable)
    html = page(login(client, world.bob))
    assert re.findall(
        r'<tr class="budget-row[^"]*"><td>.*?</td><td class="n">(.*?)</td><td class="n">(.*?)</td>', html
    ) == [
        ("10.00", "-"),
        ("5.00", "-"),
    ]


# --- query counts -----------------------------------------------------------------------------------------------------


def grow(world: World, count: int) -> None:
    """`count` more members of ml, each with two keys, a budget and usage on three days and two models."""
    for index in range(count):
        user = User.objects.create_user(f"member-{index}")
        Membership.objects.create(team=world.ml, user=user)
        Budget.objects.create(team=world.ml, user=user, amount=Decimal(1), window="day")
        for number in range(2):
            key = ApiKey.issue(f"key-{index}-{number}", team=world.ml, user=user)[0]
            ApiKey.issue(f"bob-{index}-{number}", team=world.ml, user=world.bob)
            for day in range(3):
                spent(key, TODAY - timedelta(days=day), "0.1", model=("tiny-llama", "tiny-qwen")[number])
        newest = ApiKey.objects.filter(user=world.bob).latest("id")
        Budget.objects.create(key=newest, amount=Decimal(1), window="day")
        spent(newest, TODAY, "0.1", model=f"model-{index}")


def queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        assert client.get(url).status_code == 200
    return len(captured)


@pytest.mark.parametrize(
    ("who", "url", "expected"), [("bob", ME, 7), ("ada", "team", 9)]
)  # the team page: its showback too (two)
def test_each_page_runs_the_same_queries_whatever_it_shows(world, who, url, expected):
    client = login(Client(), getattr(world, who))
    url = f"/me/teams/{world.ml.pk}/" if url == "team" else url
    before = queries(client, url)
    grow(world, 12)
    # The session and the user, then /me/: teams, keys, budgets, usage, the new key form's teams; a team's page: the
    # team with one's role in it, members, keys, budgets, usage.
    assert (before, queries(client, url)) == (expected, expected)


# --- through a real router ---------------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_key_revoked_on_the_page_is_refused_by_a_router_within_a_second(start_router, start_engine):
    get_hub().publish_endpoints(make_table([start_engine().url]))
    router = start_router(get_hub())
    team = Team.objects.create(name="ml", allowed_models=[MODEL])
    bob = User.objects.create_user("bob")
    Membership.objects.create(team=team, user=bob)
    client = login(Client(), bob)
    made = client.post(ME, {"name": "notebook", "team": team.pk}).content.decode()
    plaintext = re.search(r'<code id="new-key-value">([^<]+)</code>', made).group(1)
    assert chat_with_key(router, plaintext).status_code == 200  # cached by the router now

    client.post(f"/me/keys/{ApiKey.objects.get(name='notebook').pk}/revoke")
    wait_until(lambda: chat_with_key(router, plaintext).status_code == 401, timeout=1)
