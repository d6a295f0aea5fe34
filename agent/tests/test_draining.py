"""Waiting for an engine to be idle before it is stopped: the rules, on a real event loop."""

import asyncio
import time

from agent import draining
from agent.tests.stand_ins import run


def reads(*values):
    """A read of the engine's load that answers `values` in turn, then repeats the last."""
    answers = list(values)

    async def read():
        return answers.pop(0) if len(answers) > 1 else answers[0]

    return read


def test_a_drain_ends_as_soon_as_the_engine_reports_zero():
    async def scenario():
        started = time.monotonic()
        why = await draining.wait_until_idle(reads(2, 1, 0), 10, asyncio.Event(), lambda: True, poll_seconds=0.01)
        return why, time.monotonic() - started

    why, elapsed = run(scenario())
    assert why == "drained: no running requests" and elapsed < 1


def test_a_busy_engine_is_waited_on_until_the_timeout_and_the_reason_says_how_busy():
    async def scenario():
        started = time.monotonic()
        why = await draining.wait_until_idle(reads(3), 0.2, asyncio.Event(), lambda: True, poll_seconds=0.05)
        return why, time.monotonic() - started

    why, elapsed = run(scenario())
    assert why == "drain timed out after 0.2 s with 3 running"
    assert 0.2 <= elapsed < 1


def test_metrics_that_cannot_be_read_are_not_taken_for_idle():
    why = run(draining.wait_until_idle(reads(None), 0.15, asyncio.Event(), lambda: True, poll_seconds=0.05))
    assert why == "drain timed out after 0.15 s with an unknown number of requests running"


def test_a_zero_timeout_still_reads_the_engine_once():
    assert run(draining.wait_until_idle(reads(0), 0, asyncio.Event(), lambda: True)) == draining.DRAINED
    assert run(draining.wait_until_idle(reads(1), 0, asyncio.Event(), lambda: True)) == (
        "drain timed out after 0 s with 1 running"
    )


def test_a_stop_interrupts_the_wait_at_once():
    async def scenario():
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.1, stop.set)
        started = time.monotonic()
        why = await draining.wait_until_idle(reads(5), 60, stop, lambda: True, poll_seconds=10)
        return why, time.monotonic() - started

    why, elapsed = run(scenario())
    assert why == draining.INTERRUPTED and elapsed < 1


def test_an_engine_that_exits_by_itself_ends_the_drain():
    alive = iter([True, False])
    why = run(draining.wait_until_idle(reads(1), 60, asyncio.Event(), lambda: next(alive), poll_seconds=0.01))
    assert why == draining.ENGINE_GONE
