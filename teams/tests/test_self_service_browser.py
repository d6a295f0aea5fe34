"""The self-service pages in a real headless Chromium (Selenium) against a live server: a member logs in, makes a key
and sees it once (not after a reload), sees the usage chart drawn, and revokes the key; a team's admin adds a member.

Needs /usr/bin/chromium and /usr/bin/chromedriver (apt: chromium chromium-driver), as the dashboard's browser test
does; without them the test is skipped with a loud reason — the one skip the project allows.
"""

import pytest
from django.contrib.auth.models import User
from django.utils import timezone

from hub.credentials import hash_secret
from keys.models import ApiKey, TokenUsage
from teams.models import Membership, Team
from tests.browser import chromium, wait_for

WAIT_SECONDS = 10

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def browser():
    yield from chromium()


def _wait_for(browser, condition, what):
    wait_for(browser, condition, what, WAIT_SECONDS, 0.1)


def _find(browser, css):
    from selenium.webdriver.common.by import By

    return browser.find_elements(By.CSS_SELECTOR, css)


def _text(browser, css):
    found = _find(browser, css)
    return found[0].text if found else ""


def _log_in(browser, base, username):
    browser.get(f"{base}/me/")  # asks for a login first
    _wait_for(browser, lambda: _find(browser, "#login-form"), "the login form")
    _find(browser, "input[name=username]")[0].send_keys(username)
    _find(browser, "input[name=password]")[0].send_keys("pw")
    _find(browser, "#login-form button[type=submit]")[0].click()
    _wait_for(browser, lambda: f"Hello, {username}" in _text(browser, "h1"), f"{username}'s page")


def test_a_member_makes_a_key_sees_it_once_and_revokes_it_and_an_admin_adds_a_member(browser, live_server):
    from selenium.webdriver.support.ui import Select

    team = Team.objects.create(name="ml")
    ada, bob = (User.objects.create_user(name, password="pw") for name in ("ada", "bob"))
    User.objects.create_user("cyd", password="pw")
    Membership.objects.create(team=team, user=ada, role=Membership.Role.ADMIN)
    Membership.objects.create(team=team, user=bob)
    older = ApiKey.issue("bob's older key", team=team, user=bob)[0]
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    TokenUsage.objects.create(
        key=older, key_name=older.name, model="llama", hour=hour, requests=3, prompt_tokens=40, completion_tokens=60,
        team=team, user=bob, spend_units=25 * 10**10,
    )  # fmt: skip

    _log_in(browser, live_server.url, "bob")
    _find(browser, "#id_name")[0].send_keys("notebook")
    Select(_find(browser, "#id_team")[0]).select_by_visible_text("ml")
    _find(browser, "button[name=create]")[0].click()
    _wait_for(browser, lambda: _find(browser, "#new-key-value"), "the new key")
    plaintext = _text(browser, "#new-key-value")
    assert "Copy it now: it will not be shown again." in _text(browser, "#new-key")
    made = ApiKey.objects.get(key_hash=hash_secret(plaintext))
    assert (made.name, made.team, made.user, made.active) == ("notebook", team, bob, True)

    bars = _find(browser, "svg.usage-chart rect.bar")
    assert len(bars) == 1 and bars[0].size["height"] > 100 and bars[0].size["width"] > 0
    assert "llama" in _text(browser, "ul.legend") and "0.25" in _text(browser, "table.usage")

    browser.refresh()  # the page asks for itself again: no second key, and the plaintext is gone
    _wait_for(browser, lambda: "Hello, bob" in _text(browser, "h1"), "the page again")
    assert not _find(browser, "#new-key-value") and plaintext not in browser.page_source
    assert ApiKey.objects.filter(name="notebook").count() == 1

    _find(browser, f"#key-{made.pk} button[name=revoke]")[0].click()
    _wait_for(browser, lambda: "revoked" in _text(browser, ".messages"), "the revocation's message")
    assert _text(browser, f"#key-{made.pk} .state") == "revoked"
    assert not ApiKey.objects.get(pk=made.pk).active and ApiKey.objects.get(pk=older.pk).active

    _find(browser, "header form button[type=submit]")[0].click()  # log out
    _wait_for(browser, lambda: _find(browser, "#login-form"), "the login form after logging out")
    _log_in(browser, live_server.url, "ada")
    _find(browser, f"a[href='/me/teams/{team.pk}/']")[0].click()
    _wait_for(browser, lambda: _text(browser, "h1") == "Team ml", "the team's page")
    _find(browser, "#id_username")[0].send_keys("cyd")
    Select(_find(browser, "#id_role")[0]).select_by_value("member")
    _find(browser, "button[name=add]")[0].click()
    _wait_for(browser, lambda: "cyd is now in the team as member." in _text(browser, ".messages"), "the new member")
    assert "cyd" in _text(browser, "#members") and Membership.objects.filter(team=team, user__username="cyd").exists()
