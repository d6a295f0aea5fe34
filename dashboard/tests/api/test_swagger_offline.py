"""The API's Swagger UI on a machine without internet: every asset comes from the project itself.

Headless Chromium is given a proxy that does not exist, so any request beyond the live server (which it
reaches directly, as a loopback address) fails; the page must still render the API's operations.
"""

import os

import pytest
from django.contrib.auth import get_user_model

from dashboard.tests.test_dashboard_browser import _wait_for
from tests.browser import CHROMEDRIVER, CHROMIUM, CHROMIUM_FLAGS

pytestmark = pytest.mark.django_db(transaction=True)

# Nothing listens on port 9 (discard): a request through this proxy fails at once, as with no network.
NO_NETWORK = ("--proxy-server=http://127.0.0.1:9",)


@pytest.fixture
def offline_browser():
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        pytest.skip(f"NO BROWSER: {', '.join(missing)} missing; apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS + NO_NETWORK:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def test_swagger_ui_renders_with_the_network_off_from_the_projects_own_assets(offline_browser, live_server):
    from selenium.webdriver.common.by import By

    browser = offline_browser
    get_user_model().objects.create_superuser("ops", "ops@example.com", "pw")
    browser.get(f"{live_server.url}/admin/login/")
    browser.find_element(By.NAME, "username").send_keys("ops")
    browser.find_element(By.NAME, "password").send_keys("pw")
    browser.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    # The session cookie is set by the login's answer: wait for it before asking for a staff-only page.
    _wait_for(browser, lambda: "/login/" not in browser.current_url, "the login went through")

    browser.get(f"{live_server.url}/api/v1/docs/")
    _wait_for(
        browser,
        lambda: browser.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock-summary-path"),
        "Swagger UI lists the API's operations",
    )
    assert "llmgw API" in browser.find_element(By.CSS_SELECTOR, ".swagger-ui .info .title").text
    paths = {e.text for e in browser.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock-summary-path")}
    assert "/api/v1/status/" in {p.replace("\u200b", "") for p in paths}
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(live_server.url) for url in loaded), loaded
