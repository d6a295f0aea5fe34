"""Headless Chromium for the browser tests (the dashboard's, the self-service pages'): one way to start it, and to
wait in it.

Needs /usr/bin/chromium and /usr/bin/chromedriver (apt: chromium chromium-driver; `make test` and `.ci/run` install
them where they may). Without them a test is skipped with a loud reason: the one skip the project allows.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,1000",
)


def chromium() -> Iterator[Any]:
    """A fixture's body: a headless Chromium driven by Selenium, quit afterwards (or the test skipped, loudly)."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        reason = f"NO BROWSER: {', '.join(missing)} missing; apt-get install chromium chromium-driver to run this test"
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.implicitly_wait(0)
    yield driver
    driver.quit()


def wait_for(browser: Any, condition: Callable[[], Any], what: str, seconds: float, poll: float) -> None:
    """Wait until `condition()` holds, polling every `poll` s, or fail after `seconds` saying `what` was awaited. An
    element the page replaced while the condition read it (a navigation under way) reads as "not yet"."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    waiting = WebDriverWait(browser, seconds, poll_frequency=poll, ignored_exceptions=[StaleElementReferenceException])
    waiting.until(lambda _: condition(), message=what)
