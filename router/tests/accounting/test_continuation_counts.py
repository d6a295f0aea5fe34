"""Broken answers counted per model between flushes (router.accounting.continuations): each outcome of the
continuation metric lands in one of continued, failed or refused, and the flusher hands the counts to the hub
with the tokens, keeping them when the hub cannot take them."""

import asyncio

import pytest

from hub import InProcessHub
from hub.contracts import ContinuationCount
from router.accounting.continuations import KIND_OF_OUTCOME, ContinuationCounter
from router.accounting.flusher import UsageFlusher
from router.forwarding import continuation, resume
from router.metrics import RouterMetrics
from router.tests.accounting.test_usage import UnreachableRedisHub
from router.tests.conftest import MODEL, make_table, new_picker


def counts(continued=0, failed=0, refused=0, reprocessed=0):
    return ContinuationCount(continued=continued, failed=failed, refused=refused, reprocessed=reprocessed)


def test_the_outcomes_it_spells_out_are_the_forwarding_constants():
    assert set(KIND_OF_OUTCOME) == {
        continuation.CONTINUED,
        continuation.RESENT,
        resume.FINISHED,
        continuation.NO_REPLICA,
        continuation.LIMIT,
    }


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (continuation.CONTINUED, counts(continued=1)),
        (continuation.RESENT, counts(continued=1)),
        (resume.FINISHED, counts(continued=1)),
        (continuation.NO_REPLICA, counts(failed=1)),
        (continuation.LIMIT, counts(failed=1)),
        ("guided", counts(refused=1)),
        ("tool_call", counts(refused=1)),
        ("n", counts(refused=1)),
    ],
)
def test_each_outcome_counts_as_what_the_client_got(outcome, expected):
    counter = ContinuationCounter()
    counter.count(MODEL, outcome)
    assert counter.pending() == {MODEL: expected}


def test_counts_add_up_per_model_and_a_take_starts_again_from_none():
    counter = ContinuationCounter()
    counter.count(MODEL, continuation.CONTINUED)
    counter.count(MODEL, continuation.CONTINUED)
    counter.reprocessed(MODEL, 120)
    counter.reprocessed("qwen", 0)  # a leg that re-read nothing counts nothing, not even a row
    counter.count("qwen", continuation.LIMIT)
    assert counter.take() == {MODEL: counts(continued=2, reprocessed=120), "qwen": counts(failed=1)}
    assert counter.take() == {}


def test_what_a_flush_could_not_deliver_adds_to_what_came_since():
    counter = ContinuationCounter()
    counter.count(MODEL, continuation.CONTINUED)
    taken = counter.take()
    counter.count(MODEL, "guided")
    counter.restore(taken)
    assert counter.pending() == {MODEL: counts(continued=1, refused=1)}


def flusher_on(hub):
    picker = new_picker()
    picker.routes.apply_table(make_table(["http://a:1"]))
    return UsageFlusher(hub, picker.ledger, RouterMetrics(), flush_seconds=1, router_id="r"), picker.ledger


def test_a_flush_reports_them_and_the_hub_adds_them_to_the_hour():
    hub = InProcessHub()
    flusher, ledger = flusher_on(hub)
    ledger.continuations.count(MODEL, continuation.CONTINUED)
    ledger.continuations.reprocessed(MODEL, 30)
    assert asyncio.run(flusher.flush()) is True
    assert ledger.continuations.pending() == {}
    assert list(hub.collect_usage().continuations.values()) == [{MODEL: counts(continued=1, reprocessed=30)}]


def test_a_failed_flush_keeps_them_for_the_next():
    flusher, ledger = flusher_on(UnreachableRedisHub(make_table()))
    ledger.continuations.count(MODEL, continuation.NO_REPLICA)
    assert asyncio.run(flusher.flush()) is False
    assert ledger.continuations.pending() == {MODEL: counts(failed=1)}
    ledger.continuations.count(MODEL, continuation.CONTINUED)
    working = InProcessHub()
    flusher.hub = working
    assert asyncio.run(flusher.flush()) is True
    assert list(working.collect_usage().continuations.values()) == [{MODEL: counts(continued=1, failed=1)}]
