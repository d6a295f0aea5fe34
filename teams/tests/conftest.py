"""Fixtures for the team tests: a team's scope is seen through real routers, as a key's is; budgets' counters in
the process's hub, as the team surfaces' tests hold them (dashboard/tests/teams)."""

from dashboard.tests.teams.conftest import budget_hub
from router.tests.conftest import hub, start_engine, start_router

__all__ = ["budget_hub", "hub", "start_engine", "start_router"]
