"""The suite's own isolation: each pytest-xdist worker flushes a Redis database no other worker uses."""

import re
from pathlib import Path

import pytest

from conftest import DEFAULT_REDIS_TEST_URL, redis_url_for_worker


def test_each_worker_of_two_passes_side_by_side_gets_a_redis_database_of_its_own():
    sqlite = {redis_url_for_worker("redis://127.0.0.1:6379/15", w) for w in ("gw0", "gw1")}
    postgres = {redis_url_for_worker("redis://127.0.0.1:6379/14", w) for w in ("gw0", "gw1")}
    assert sqlite == {"redis://127.0.0.1:6379/15", "redis://127.0.0.1:6379/13"}
    assert postgres == {"redis://127.0.0.1:6379/14", "redis://127.0.0.1:6379/12"}
    assert redis_url_for_worker("redis://127.0.0.1:6379/3", "gw0") == "redis://127.0.0.1:6379/3"


def test_a_redis_url_leaving_no_database_for_a_worker_is_refused_naming_it():
    with pytest.raises(ValueError, match="leaves no database for xdist worker gw2"):
        redis_url_for_worker("redis://127.0.0.1:6379/1", "gw2")


def test_a_run_by_hand_flushes_none_of_the_databases_of_make_tests_unit_passes():
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    passes = set(re.findall(r"REDIS_TEST_URL=(redis://\S+)", makefile))
    assert passes == {"redis://127.0.0.1:6379/15", "redis://127.0.0.1:6379/14"}
    theirs = {redis_url_for_worker(url, w) for url in passes for w in ("gw0", "gw1")}
    mine = {redis_url_for_worker(DEFAULT_REDIS_TEST_URL, w) for w in ("gw0", "gw1")}
    assert not mine & theirs
