"""Broken streams reach the control plane's figures: a stream whose engine dies, continued on another replica (or
refused), is counted in the router's usage report beside its metric, and the hub has it for the tick.

The streams are broken as test_continued_streams breaks them: the bundled mock engine dies after a few tokens."""

from __future__ import annotations

import pytest

from conftest import wait_until
from hub.contracts import ContinuationCount, ContinuationCounts, add_continuation_counts
from router.tests.conftest import MODEL
from router.tests.forwarding.test_continued_streams import CHAT, COMPLETIONS, events_of, fleet, request_body
from router.tests.forwarding.test_proxy import metric

__all__ = ["fleet"]  # the fixture, imported for pytest to find

pytestmark = pytest.mark.django_db(transaction=True)


def reported(hub, done) -> ContinuationCount:
    """The counts of MODEL the router's flushes handed `hub`, taken as the tick takes them, once `done(counts)`."""
    seen: ContinuationCounts = {}

    def collected():
        for counts in hub.collect_usage().continuations.values():
            add_continuation_counts(seen, counts)
        return MODEL in seen and done(seen[MODEL])

    wait_until(collected, timeout=5)
    return seen[MODEL]


def test_a_continued_stream_is_counted_in_the_usage_report_with_the_prompt_tokens_re_read(fleet, hub, auth):
    router, _, _ = fleet(True, flush_seconds=0.05)
    events = events_of(router.url, COMPLETIONS, request_body(COMPLETIONS), auth)
    assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)

    counts = reported(hub, lambda c: c.reprocessed)
    reread = metric(router, f'llmgw_router_continuation_prompt_tokens_total{{model="{MODEL}"}}')
    assert counts == ContinuationCount(continued=1, failed=0, refused=0, reprocessed=int(reread))
    assert router.state.ledger.continuations.pending() == {}  # flushed: nothing is counted twice


def test_a_refused_stream_is_counted_as_refused(fleet, hub, auth):
    router, _, _ = fleet(True, flush_seconds=0.05)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    events = events_of(router.url, CHAT, request_body(CHAT, response_format=schema), auth)
    assert events[-2]["error"]["code"] == "upstream_failed"
    assert reported(hub, lambda c: c.refused) == ContinuationCount(continued=0, failed=0, refused=1, reprocessed=0)
