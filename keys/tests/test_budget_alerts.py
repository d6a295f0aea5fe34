"""Soft limits: a budget whose spend and reservations reach its soft limit in its window is alerted once for that
window, POSTed as JSON to its alert URL (a real HTTP server here), tried again while the endpoint fails; the next
window is alerted anew; a budget below its soft limit is not."""

import json
import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hub import InProcessHub
from hub.budgets import Limit, Reservation, counter_name
from keys.alerts import RETRY_SECONDS, check_budget_alerts
from keys.models import ApiKey, Budget, BudgetAlert
from teams.models import Team

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 12, 4, 10, 0, tzinfo=UTC)
DAY_START = datetime(2026, 12, 4, tzinfo=UTC)


class AlertEndpoint:
    """A local HTTP server that records what is POSTed to it and answers `status`."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        self.status = 200
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                length = int(self.headers["Content-Length"])
                endpoint.received.append(json.loads(self.rfile.read(length)))
                self.send_response(endpoint.status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def endpoint():
    server = AlertEndpoint()
    yield server
    server.close()


def spend(hub: InProcessHub, budget: Budget, amount: Decimal, start: datetime | None = DAY_START) -> None:
    """Hold `amount` in the budget's counter of the window beginning at `start` (a settled answer)."""
    units = int(amount.scaleb(12))
    counter = counter_name(budget.pk, start)
    rid = f"r{counter}{units}"
    assert hub.budgets.reserve(Reservation(rid, units, [Limit(counter, 10**20)], 60, "d m")) is None


def test_the_soft_limit_is_alerted_once_per_window_with_what_was_used(endpoint, django_assert_max_num_queries):
    team = Team.objects.create(name="ml")
    budget = Budget.objects.create(
        team=team, amount=Decimal("10"), window="day", soft_limit_percent=80, alert_url=endpoint.url
    )
    hub = InProcessHub()
    spend(hub, budget, Decimal("7.99"))
    assert check_budget_alerts(hub, NOW) == 0 and endpoint.received == []  # below 80 %
    spend(hub, budget, Decimal("0.01"))
    # The budgets, the alerts made, a savepoint around the new one, the alerts due, the delivery noted.
    with django_assert_max_num_queries(7):
        assert check_budget_alerts(hub, NOW) == 1
    assert endpoint.received == [
        {
            "type": "budget.soft_limit",
            "budget": budget.pk,
            "scope": "team “ml”",
            "team": "ml",
            "window": "day",
            "timezone": "UTC",
            "window_start": "2026-12-04T00:00:00+00:00",
            "amount": "10.000000",
            "used": "8.000000",
            "soft_limit_percent": 80,
        }
    ]
    spend(hub, budget, Decimal("1"))
    assert check_budget_alerts(hub, NOW + timedelta(hours=1)) == 0 and len(endpoint.received) == 1  # once a window
    # The next day is a window of its own.
    tomorrow = NOW + timedelta(days=1)
    spend(hub, budget, Decimal("9"), DAY_START + timedelta(days=1))
    assert check_budget_alerts(hub, tomorrow) == 1
    assert endpoint.received[-1]["window_start"] == "2026-12-05T00:00:00+00:00"
    assert BudgetAlert.objects.filter(budget=budget).count() == 2


def test_an_endpoint_that_fails_is_tried_again_later_until_it_takes_the_alert(endpoint):
    key, _ = ApiKey.issue("ci")
    budget = Budget.objects.create(
        key=key, amount=Decimal("1"), window="none", soft_limit_percent=50, alert_url=endpoint.url
    )
    hub = InProcessHub()
    spend(hub, budget, Decimal("0.6"), None)
    endpoint.status = 503
    assert check_budget_alerts(hub, NOW) == 0
    alert = BudgetAlert.objects.get()
    assert (alert.attempts, alert.delivered_at) == (1, None) and "503" in alert.last_error
    assert check_budget_alerts(hub, NOW + timedelta(seconds=RETRY_SECONDS - 1)) == 0  # not yet
    endpoint.status = 200
    assert check_budget_alerts(hub, NOW + timedelta(seconds=RETRY_SECONDS)) == 1
    alert.refresh_from_db()
    assert alert.attempts == 2 and alert.delivered_at is not None and alert.last_error == ""
    assert [body["scope"] for body in endpoint.received] == ["key “ci”", "key “ci”"]
    assert check_budget_alerts(hub, NOW + timedelta(hours=1)) == 0 and len(endpoint.received) == 2


def test_a_budget_without_soft_limit_or_without_url_sends_nothing(endpoint, caplog):
    team = Team.objects.create(name="ml")
    silent = Budget.objects.create(team=team, amount=Decimal("1"), window="none")
    logged = Budget.objects.create(team=team, amount=Decimal("1"), window="day", soft_limit_percent=10)
    hub = InProcessHub()
    spend(hub, silent, Decimal("1"), None)
    spend(hub, logged, Decimal("1"))
    assert check_budget_alerts(hub, NOW) == 0
    assert [a.budget for a in BudgetAlert.objects.all()] == [logged]  # made, and logged only
    assert "reached 10% of 1.000000" in caplog.text and endpoint.received == []
