"""The sweep of requests in flight: disconnect watches only for requests still running after the delay, an engine
overdue cancelled as a timeout (each wait its own deadline, a slow client not counted), and no timer left once nothing
is in flight."""

import asyncio

import pytest

from router.background import BackgroundTasks
from router.forwarding.exchange import DISCONNECT_WATCH_DELAY, FIRST_BYTE, NEXT_CHUNK, Exchange
from router.forwarding.inflight import MIN_SWEEP_SECONDS, SWEEP_SECONDS, InFlight


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
            return await scenario(InFlight(tasks, first_byte_timeout=0.3, idle_timeout=0.5), tasks)
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

    assert run(scenario) == (True, None, 0)


@pytest.mark.parametrize(
    "start, phase, deadline",
    [(Exchange.start_first_byte_deadline, FIRST_BYTE, 0.3), (Exchange.start_next_chunk_deadline, NEXT_CHUNK, 0.5)],
)
def test_an_engine_overdue_is_cancelled_within_two_sweeps_of_its_deadline_and_not_before(start, phase, deadline):
    async def scenario(in_flight, tasks):
        loop = asyncio.get_running_loop()

        async def request():
            exchange = in_flight.begin("k", Client().receive)
            start(exchange)
            began = loop.time()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                overdue = exchange.deadline_passed()
                return loop.time() - began, overdue, exchange.deadline_passed(), asyncio.current_task().cancelling()
            finally:
                in_flight.end(exchange)

        return await asyncio.wait_for(request(), 3)

    waited, overdue, asked_again, cancelling = run(scenario)
    assert (overdue, cancelling) == (phase, 0)
    assert asked_again is None  # taken back once: a later cancellation is not mistaken for it
    assert deadline <= waited <= deadline + 2 * 0.075 + 0.1  # the deadline, two sweeps, and a busy machine's slack


def test_each_wait_has_its_own_deadline_and_time_spent_sending_to_the_client_does_not_count():
    async def scenario(in_flight, tasks):
        exchange = in_flight.begin("k", Client().receive)
        exchange.start_first_byte_deadline()
        await asyncio.sleep(0.2)  # the first attempt fails after 0.2 s: the second one is sent
        exchange.start_first_byte_deadline()
        await asyncio.sleep(0.2)  # 0.4 s since the first send, 0.2 s since the second: not overdue
        in_time = [exchange.overdue]
        exchange.start_next_chunk_deadline()  # the answer began
        for _ in range(3):  # chunks 0.3 s apart: each within the idle deadline of the one before
            await asyncio.sleep(0.3)
            exchange.start_next_chunk_deadline()
        in_time.append(exchange.overdue)
        exchange.stop_deadline()  # sending to a client slower than the idle deadline
        await asyncio.sleep(0.8)
        in_time.append(exchange.overdue)
        in_flight.end(exchange)
        return in_time

    assert run(scenario) == [None, None, None]


def test_the_sweep_runs_often_enough_for_short_deadlines_and_no_more_often_than_needed():
    tasks = BackgroundTasks()
    assert InFlight(tasks, first_byte_timeout=600, idle_timeout=120).period == SWEEP_SECONDS
    assert InFlight(tasks, first_byte_timeout=0.2, idle_timeout=5).period == pytest.approx(0.05)
    assert InFlight(tasks, first_byte_timeout=5, idle_timeout=0.2).period == pytest.approx(0.05)
    assert InFlight(tasks, first_byte_timeout=0.001, idle_timeout=5).period == MIN_SWEEP_SECONDS
    with pytest.raises(ValueError, match="first_byte_timeout and idle_timeout"):
        InFlight(tasks, first_byte_timeout=0, idle_timeout=5)
