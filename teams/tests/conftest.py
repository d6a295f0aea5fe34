"""Fixtures for the team tests: a team's scope is seen through real routers, as a key's is."""

from router.tests.conftest import hub, start_engine, start_router

__all__ = ["hub", "start_engine", "start_router"]
