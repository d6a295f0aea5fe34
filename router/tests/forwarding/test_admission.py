"""A full model's requests wait in the router's fair queue (router.forwarding.admission), with real mock engines
whose batch is bounded (`--max-num-seqs`) as the profile's max concurrency says: priority classes, teams' shares,
the bounds, keep-alives, and the engine's own queue left empty."""

import asyncio
import json
import time

import aiohttp
import httpx
import pytest

from conftest import wait_until
from keys.models import ApiKey
from router.tests.conftest import MODEL, make_table
from teams.models import Team

pytestmark = pytest.mark.django_db(transaction=True)

GREEDY = ("--greedy",)


def serve(start_router, hub, engine_process, capacity: int, token_delay_ms: float = 20, **router):
    """A router over one mock engine running `capacity` requests at once, published with that capacity."""
    engine = engine_process(token_delay_ms=token_delay_ms, args=(*GREEDY, "--max-num-seqs", str(capacity)))
    router.setdefault("keepalive_seconds", 0)
    server = start_router(**router)
    hub.publish_endpoints(make_table([{"url": engine.url, "capacity": capacity}]))
    wait_until(lambda: server.state.routes.by_model.get(MODEL))
    return server, engine


def key(name: str, **fields) -> dict[str, str]:
    return {"Authorization": f"Bearer {ApiKey.issue(name, **fields)[1]}"}


async def post(session, router, headers, tokens: int, stream: bool = False, extra_headers=None):
    """One chat completion of `tokens` tokens: (status, when it ended, body or error)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": tokens, "stream": stream}
    async with session.post(
        f"{router.url}/v1/chat/completions", json=body, headers={**headers, **(extra_headers or {})}
    ) as response:
        text = await response.text()
        return response.status, time.monotonic(), text, dict(response.headers)


def queued(router) -> int:
    return len(router.state.proxy.admission.models[MODEL].queue) if MODEL in router.state.proxy.admission.models else 0


def batch_running(admission) -> int:
    return sum(use.running for (_, priority), use in admission.models[MODEL].shares.tenants.items() if priority == 2)


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_model_below_its_capacity_queues_nothing(start_router, hub, engine_process):
    router, _ = serve(start_router, hub, engine_process, capacity=4)
    headers = key("below")

    async def go():
        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(*(post(session, router, headers, 5) for _ in range(4)))

    assert [status for status, *_ in run(go())] == [200] * 4
    assert router.state.proxy.admission.models[MODEL].queue.by_class() == {}
    assert b"llmgw_router_queue_wait_seconds_count" not in router.state.metrics.render()


def test_requests_past_capacity_wait_in_the_router_and_the_engines_queue_stays_empty(start_router, hub, engine_process):
    router, engine = serve(start_router, hub, engine_process, capacity=2)
    headers = key("past")
    engine_waiting, demand = [], []

    async def go():
        async with aiohttp.ClientSession() as session:
            sent = [asyncio.create_task(post(session, router, headers, 20)) for _ in range(6)]
            while not all(task.done() for task in sent):
                # What the control plane scales on: those waiting in the router count as in flight.
                demand.extend(mark.in_flight.get(MODEL, 0) for mark in hub.router_marks())
                async with session.get(f"{engine.url}/metrics") as response:
                    text = await response.text()
                line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_waiting"))
                engine_waiting.append(float(line.split()[-1]))
                await asyncio.sleep(0.02)
            return [task.result() for task in sent]

    assert [status for status, *_ in run(go())] == [200] * 6
    assert max(engine_waiting) == 0, "the router held what the engine could not run"
    assert max(demand) == 6
    metrics = router.state.metrics.render().decode()
    assert 'llmgw_router_queue_wait_seconds_count{class="standard",model="llama-3-8b"} 4.0' in metrics


def test_interactive_leaves_before_standard_and_batch_waits_for_spare_room_and_a_header_only_lowers(
    start_router, hub, engine_process
):
    router, _ = serve(start_router, hub, engine_process, capacity=1)
    interactive = key("interactive", priority_class="interactive")
    standard = key("standard")
    ended: dict[str, float] = {}

    async def go():
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(post(session, router, standard, 30))  # takes the only slot
            await asyncio.sleep(0.2)
            waiting = {
                "batch": post(session, router, standard, 2, extra_headers={"LLMGW-Priority": "batch"}),
                "standard": post(session, router, standard, 2),
                # Its key is interactive: asking for interactive again changes nothing, for batch would lower it.
                "interactive": post(session, router, interactive, 2, extra_headers={"LLMGW-Priority": "interactive"}),
                "raised": post(session, router, standard, 2, extra_headers={"LLMGW-Priority": "interactive"}),
            }
            tasks = {}
            for name, coroutine in waiting.items():
                tasks[name] = asyncio.create_task(coroutine)
                await asyncio.sleep(0.05)  # arrival order: batch, standard, interactive, "raised" (standard)
            await first
            for name in ("interactive", "standard", "raised"):
                status, at, *_ = await tasks[name]
                assert status == 200, name
                ended[name] = at
            # Batch runs only in room the other classes' last minute leaves: with one slot, none is spare.
            await asyncio.sleep(0.3)
            assert not tasks["batch"].done()
            assert router.state.proxy.admission.waiting() == {(MODEL, "batch"): 1}
            tasks["batch"].cancel()
            await asyncio.gather(tasks["batch"], return_exceptions=True)
            await asyncio.to_thread(wait_until, lambda: queued(router) == 0, 5)

    run(go())
    assert ended["interactive"] < ended["standard"] < ended["raised"]


def test_a_bad_priority_header_is_refused_naming_the_classes(start_router, hub, engine_process):
    router, _ = serve(start_router, hub, engine_process, capacity=1)
    response = httpx.post(
        f"{router.url}/v1/chat/completions",
        headers={**key("bad"), "LLMGW-Priority": "urgent"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid_priority"
    assert "interactive, standard, batch" in error["message"] and "urgent" in error["message"]


def test_a_team_past_its_queue_bound_gets_429_while_another_team_still_waits(start_router, hub, engine_process):
    router, _ = serve(start_router, hub, engine_process, capacity=1, queue_max_waiting=2)
    flooding = key("a", team=Team.objects.create(name="flooding"))
    other = key("b", team=Team.objects.create(name="other"))

    async def go():
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(post(session, router, flooding, 40))
            await asyncio.sleep(0.2)
            waiting = [asyncio.create_task(post(session, router, flooding, 2)) for _ in range(2)]
            await asyncio.sleep(0.1)
            refused = await post(session, router, flooding, 2)
            others = await asyncio.gather(first, *waiting, post(session, router, other, 2))
            return refused, others

    (status, _, text, headers), others = run(go())
    assert status == 429
    error = json.loads(text)["error"]
    assert error["code"] == "queue_full"
    assert "team “flooding”" in error["message"] and "LLMGW_QUEUE_MAX_WAITING" in error["message"]
    assert int(headers["Retry-After"]) >= 1
    assert [s for s, *_ in others] == [200] * 4
    metrics = router.state.metrics.render().decode()
    assert 'llmgw_router_queue_refused_total{class="standard",model="llama-3-8b",reason="full"} 1.0' in metrics


def test_a_request_waiting_past_its_bound_gets_503_naming_its_wait(start_router, hub, engine_process):
    router, _ = serve(start_router, hub, engine_process, capacity=1, queue_max_wait_seconds=0.3)
    headers = key("slow")

    async def go():
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(post(session, router, headers, 60))
            await asyncio.sleep(0.2)
            late = await post(session, router, headers, 2)
            return late, await first

    (status, _, text, _), (first_status, *_) = run(go())
    assert (status, first_status) == (503, 200)
    assert "queue_timeout" in text and "waited 0.3 s" in text and "LLMGW_QUEUE_MAX_WAIT_SECONDS" in text
    assert queued(router) == 0


def test_a_stream_waiting_longer_than_a_keepalive_hears_them_then_its_answer(start_router, hub, engine_process):
    router, _ = serve(start_router, hub, engine_process, capacity=1, keepalive_seconds=0.1)
    headers = key("stream")

    async def go():
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(post(session, router, headers, 40))
            await asyncio.sleep(0.2)
            streamed = await post(session, router, headers, 3, stream=True)
            await first
            return streamed

    status, _, text, _ = run(go())
    assert status == 200
    assert text.startswith(": waiting for capacity of this model")
    assert text.rstrip().endswith("data: [DONE]")


def test_a_client_that_leaves_while_waiting_gives_its_place_up(start_router, hub, engine_process):
    router, _ = serve(start_router, hub, engine_process, capacity=1)
    headers = key("leaver")

    async def go():
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(post(session, router, headers, 40))
            await asyncio.sleep(0.2)
            leaving = asyncio.create_task(post(session, router, headers, 2))
            await asyncio.sleep(0.2)
            assert queued(router) == 1
            leaving.cancel()
            await asyncio.gather(leaving, return_exceptions=True)
            await asyncio.to_thread(wait_until, lambda: queued(router) == 0, 5)
            await first
            return await post(session, router, headers, 2)

    assert run(go())[0] == 200
    assert router.state.picker.routes.by_model[MODEL][0].outstanding == 0


def test_a_team_arriving_behind_a_flood_is_served_next(start_router, hub, engine_process):
    router, _ = serve(start_router, hub, engine_process, capacity=1)
    flood = key("flood", team=Team.objects.create(name="flood"))
    light = key("light", team=Team.objects.create(name="light"))
    order: list[str] = []

    async def go():
        async with aiohttp.ClientSession() as session:

            async def one(name, headers, tokens):
                status, *_ = await post(session, router, headers, tokens)
                order.append(name)
                return status

            first = asyncio.create_task(one("flood", flood, 20))
            await asyncio.sleep(0.2)
            floods = [asyncio.create_task(one("flood", flood, 5)) for _ in range(6)]
            await asyncio.sleep(0.1)
            late = asyncio.create_task(one("light", light, 5))
            return await asyncio.gather(first, *floods, late)

    assert run(go()) == [200] * 8
    # The first flood request ran, one more left the queue as it ended (charged ahead of the light team's
    # arrival, which found the flood team's virtual time already ahead): the light one is at most third.
    assert order.index("light") <= 2, order


def test_batch_takes_only_the_room_the_other_classes_left_over_the_last_minute(start_router, hub, engine_process):
    router, _ = serve(start_router, hub, engine_process, capacity=4)
    interactive = key("chat", priority_class="interactive")
    batch = key("job", priority_class="batch")
    admission = router.state.proxy.admission

    async def go():
        async with aiohttp.ClientSession() as session:
            # Two interactive requests at once: the room batch leaves them for a minute.
            await asyncio.gather(*(post(session, router, interactive, 5) for _ in range(2)))
            jobs = [asyncio.create_task(post(session, router, batch, 20)) for _ in range(6)]
            await asyncio.sleep(0.2)
            in_flight_batch = batch_running(admission)
            started = time.monotonic()
            chat = await post(session, router, interactive, 1)
            waited = time.monotonic() - started
            results = await asyncio.gather(*jobs)
            return in_flight_batch, waited, chat, results

    in_flight_batch, waited, chat, results = run(go())
    assert in_flight_batch == 1, "capacity 4 less the 2 interactive requests seen in flight, and one more"
    assert chat[0] == 200 and waited < 0.3, "an interactive request found a slot free"
    assert [status for status, *_ in results] == [200] * 6
    assert batch_running(admission) == 0


def test_an_engine_scheduling_by_priority_gets_each_requests_class_and_a_clients_own_is_overwritten(
    start_router, hub, engine_process
):
    # No capacity published: the router sends everything on and the engine's own queue orders it.
    engine = engine_process(token_delay_ms=20, args=(*GREEDY, "--max-num-seqs", "1", "--scheduling-policy", "priority"))
    router = start_router(keepalive_seconds=0)
    hub.publish_endpoints(make_table([engine.url], {MODEL: {"priority_scheduling": True}}))
    wait_until(lambda: MODEL in router.state.routes.by_priority)
    interactive = key("interactive", priority_class="interactive")
    standard = key("standard")
    ended: dict[str, float] = {}

    async def go():
        async with aiohttp.ClientSession() as session:
            first = asyncio.create_task(post(session, router, standard, 30))
            await asyncio.sleep(0.2)
            tasks = {}
            for name, headers, extra in (
                ("batch", standard, {"LLMGW-Priority": "batch"}),
                ("standard", standard, None),
                ("interactive", interactive, None),
            ):
                tasks[name] = asyncio.create_task(post(session, router, headers, 2, extra_headers=extra))
                await asyncio.sleep(0.05)
            # A client's own `priority` does not jump the engine's queue: the router sets its class's.
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "priority": -9}
            async with session.post(f"{router.url}/v1/chat/completions", json=body, headers=standard) as response:
                assert response.status == 200
                ended["cheeky"] = time.monotonic()
            await first
            for name, task in tasks.items():
                status, at, *_ = await task
                assert status == 200, name
                ended[name] = at

    run(go())
    assert ended["interactive"] < ended["standard"] < ended["cheeky"] < ended["batch"]


def test_each_of_n_routers_takes_a_1_over_n_share_of_a_replicas_capacity(start_router, hub, engine_process):
    engine = engine_process(token_delay_ms=20, args=(*GREEDY, "--max-num-seqs", "4"))
    one, other = start_router(keepalive_seconds=0), start_router(keepalive_seconds=0)
    hub.publish_endpoints(make_table([{"url": engine.url, "capacity": 4}]))
    # Both report usage to the hub: each learns there are two (as keys' rate limits do).
    wait_until(lambda: one.state.ledger.limits.routers == 2 and other.state.ledger.limits.routers == 2, 5)
    headers = key("shared")
    running: list[int] = []

    async def go():
        async with aiohttp.ClientSession() as session:
            sent = [asyncio.create_task(post(session, one, headers, 20)) for _ in range(4)]
            while not all(task.done() for task in sent):
                running.append(one.state.routes.by_model[MODEL][0].outstanding)
                await asyncio.sleep(0.01)
            return [task.result()[0] for task in sent]

    assert run(go()) == [200] * 4
    assert max(running) == 2, "half of the replica's 4"
