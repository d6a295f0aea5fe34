"""The sweep of requests in flight: disconnect watches only for requests still running after the delay, an overdue
first byte cancelled as a timeout (each attempt its own deadline), and no timer left once nothing is in flight."""

import asyncio

import pytest

from router.background import BackgroundTasks
from router.inflight import DISCONNECT_WATCH_DELAY, MIN_SWEEP_SECONDS, SWEEP_SECONDS, InFlight


class Client:
    """A request's `receive`: blocks until the client leaves; counts the watches waiting on it."""

    def __init__(self):
        self.left = asyncio.Event()
        self.watching = 0

    async def receive(self):
        self.watching += 1
        await self.left.wait()
        return {"type": "http.disconnect"}


def run(scenario):
    async def main():
        tasks = BackgroundTasks()
        try:
            return await scenario(InFlight(tasks, first_byte_timeout=0.3), tasks)
        finally:
            await tasks.cancel_all()

    return asyncio.run(main())


def sweeping():
    """Whether the sweep task is running (tasks other than the test's own)."""
    return any(task.get_name() == "router-in-flight-sweep" for task in asyncio.all_tasks())


def test_only_requests_still_running_after_the_delay_get_a_watch_and_the_sweep_then_ends():
    async def scenario(in_flight, tasks):
        quick_client, slow_client = Client(), Client()

        async def request(client, seconds):
            exchange = in_flight.begin("k", client.receive)
            await asyncio.sleep(seconds)
            in_flight.end(exchange)

        await asyncio.gather(request(quick_client, DISCONNECT_WATCH_DELAY / 4), request(slow_client, 0.6))
        await asyncio.sleep(2 * in_flight.period)
        return quick_client.watching, slow_client.watching, sweeping(), len(in_flight)

    quick, slow, still_sweeping, left = run(scenario)
    assert (quick, slow) == (0, 1)
    assert (still_sweeping, left) == (False, 0)  # nothing in flight: no timer left behind


def test_a_client_that_leaves_cancels_its_request_which_tells_that_cancellation_apart():
    async def scenario(in_flight, tasks):
        client = Client()

        async def request():
            exchange = in_flight.begin("k", client.receive)
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return exchange.client_gone(), exchange.deadline_passed(), asyncio.current_task().cancelling()
            finally:
                in_flight.end(exchange)

        task = asyncio.ensure_future(request())
        await asyncio.sleep(DISCONNECT_WATCH_DELAY + 3 * in_flight.period)
        client.left.set()
        return await asyncio.wait_for(task, 2)

    assert run(scenario) == (True, False, 0)


def test_a_first_byte_overdue_is_cancelled_within_two_sweeps_of_its_deadline_and_not_before():
    async def scenario(in_flight, tasks):
        loop = asyncio.get_running_loop()

        async def request():
            exchange = in_flight.begin("k", Client().receive)
            exchange.awaiting = True
            began = loop.time()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                return loop.time() - began, exchange.deadline_passed(), asyncio.current_task().cancelling()
            finally:
                in_flight.end(exchange)

        return await asyncio.wait_for(request(), 3)

    waited, timed_out, cancelling = run(scenario)
    assert (timed_out, cancelling) == (True, 0)
    assert 0.3 <= waited <= 0.3 + 2 * 0.075 + 0.1  # the deadline, two sweeps, and a busy machine's slack


def test_each_attempt_has_its_own_first_byte_deadline_and_an_answer_ends_it():
    async def scenario(in_flight, tasks):
        exchange = in_flight.begin("k", Client().receive)
        exchange.awaiting = True
        await asyncio.sleep(0.2)  # the first attempt fails after 0.2 s: the second one is sent
        exchange.awaiting, exchange.due = True, None
        await asyncio.sleep(0.2)  # 0.4 s since the first send, 0.2 s since the second: not overdue
        second_in_time = not exchange.timed_out
        exchange.awaiting = False  # its answer began
        await asyncio.sleep(0.5)
        in_flight.end(exchange)
        return second_in_time, exchange.timed_out

    assert run(scenario) == (True, False)


def test_the_sweep_runs_often_enough_for_a_short_first_byte_deadline_and_no_more_often_than_needed():
    tasks = BackgroundTasks()
    assert InFlight(tasks, first_byte_timeout=600).period == SWEEP_SECONDS
    assert InFlight(tasks, first_byte_timeout=0.2).period == pytest.approx(0.05)
    assert InFlight(tasks, first_byte_timeout=0.001).period == MIN_SWEEP_SECONDS
    with pytest.raises(ValueError, match="first_byte_timeout"):
        InFlight(tasks, first_byte_timeout=0)
