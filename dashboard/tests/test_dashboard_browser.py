"""The dashboard in a real headless Chromium (Selenium) against a live server: log in, watch panels update, stop a replica.

Needs /usr/bin/chromium and /usr/bin/chromedriver (apt: chromium chromium-driver; `make test`
and `.ci/run` install them where they may). Without them the test is skipped with a loud reason —
the one skip the project allows.
"""

import time

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from keys.models import TokenUsage
from reconciler.choices import ReplicaState
from reconciler.models import Replica
from tests.browser import chromium, wait_for
from tests.fleet import make_model, make_node, make_replica

WAIT_SECONDS = 15
"""Long enough for two turns of the 5 s fetch loop."""

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def browser():
    yield from chromium()


def _wait_for(browser, condition, what):
    wait_for(browser, condition, what, WAIT_SECONDS, 0.2)


def _text(browser, css):
    from selenium.webdriver.common.by import By

    found = browser.find_elements(By.CSS_SELECTOR, css)
    return found[0].text if found else ""


def test_staff_sees_panels_update_live_stops_a_replica_and_is_told_when_the_session_lapses(browser, live_server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    get_user_model().objects.create_superuser("ops", "ops@example.com", "pw")
    node = make_node("gpu-a", gpus=8, fabric="ib-a")
    profile = make_model("llama-70b", gpus_per_node=4, min_replicas=0).profiles.get()
    serving = make_replica(profile, placement=[(node, [0, 1, 2, 3])], endpoint="http://127.0.0.1:21000")
    doomed = make_replica(profile, placement=[(node, [4, 5, 6, 7])], endpoint="http://127.0.0.1:21001")

    started = time.monotonic()
    browser.get(f"{live_server.url}/")  # `/` sends to the dashboard, which asks for a login
    browser.find_element(By.NAME, "username").send_keys("ops")
    browser.find_element(By.NAME, "password").send_keys("pw")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    _wait_for(browser, lambda: "8/8 used" in _text(browser, "#capacity"), "the capacity panel")
    assert "# used" in _text(browser, "#capacity .legend")
    assert _text(browser, "#usage-none") == "No requests counted in this window."
    # Marks this page load: if the page reloaded, the mark would be gone.
    browser.execute_script("window.loadedOnce = true;")

    Replica.objects.filter(pk=doomed.pk).update(
        state=ReplicaState.FAILED, last_error="engine exited 137 (out of memory)", failure_count=1
    )
    TokenUsage.objects.create(
        key_name="team-a",
        model="llama-70b",
        hour=timezone.now().replace(minute=0, second=0, microsecond=0),
        requests=12,
        prompt_tokens=300,
        completion_tokens=200,
    )
    _wait_for(
        browser,
        lambda: "engine exited 137 (out of memory)" in _text(browser, "#failed-replicas"),
        "the failed replica to appear without a reload",
    )
    _wait_for(browser, lambda: "12 req" in _text(browser, "#usage svg"), "the usage chart to show the new requests")
    assert "500 tok" in _text(browser, "#usage svg")
    assert browser.execute_script("return window.loadedOnce === true;"), "the page was reloaded"
    assert int(browser.find_element(By.ID, "fleet-panels").get_attribute("data-refreshes")) >= 1
    assert "Live: panels refreshed" in _text(browser, "#live-status")

    # An admin action from the replicas list, and its message.
    browser.get(f"{live_server.url}/admin/reconciler/replica/")
    browser.find_element(By.CSS_SELECTOR, f"input[name=_selected_action][value='{serving.pk}']").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("stop_replicas")
    browser.find_element(By.CSS_SELECTOR, "button[name=index]").click()
    _wait_for(browser, lambda: "Asked 1 replica(s) to stop" in _text(browser, "ul.messagelist"), "the stop message")
    assert Replica.objects.get(pk=serving.pk).state == ReplicaState.STOPPING

    # A lapsed session: the loop keeps the last panels and says they may be stale.
    browser.get(f"{live_server.url}/admin/")
    _wait_for(browser, lambda: "stopping" in _text(browser, "#fleet-panels"), "the dashboard again")
    browser.delete_cookie("sessionid")
    _wait_for(browser, lambda: "session expired" in _text(browser, "#live-status"), "the stale notice")
    assert "8/8 used" in _text(browser, "#capacity")
    assert time.monotonic() - started < 30
