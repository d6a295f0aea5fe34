"""Fixtures for the key tests: what a key does is seen through real routers, so the router tests' engine
stand-in, router server and hub fixtures serve here too."""

from router.tests.conftest import hub, start_engine, start_router

__all__ = ["hub", "start_engine", "start_router"]
