"""Moving streams off a replica leaving service, in the router's own terms: a move cuts a stream only while it waits
on its engine (never while a chunk is sent), it is told apart from any other cancellation, each move happens at the
time the table names, and a stream that could not be continued is left alone (router.forwarding.moves)."""

import asyncio
import json

from router.background import BackgroundTasks
from router.errors import ReplicaLeaving
from router.forwarding import moves as moves_module
from router.forwarding.exchange import MOVE, Exchange, Forwarding
from router.forwarding.inflight import InFlight
from router.forwarding.moves import StreamMoves, may_move
from router.forwarding.transcript import Transcript


async def never_leaves():
    await asyncio.Event().wait()


def stream(body: dict, exchange: Exchange | None = None) -> Forwarding:
    """A continuable stream's request (chat), on its first leg."""
    exchange = exchange or Exchange("k", never_leaves, None)
    request = Forwarding(
        scope={}, send=None, path="/v1/chat/completions", model="m", body=json.dumps(body).encode(), exchange=exchange
    )
    request.transcript = Transcript(chat=True, client_ids=False, asked_ids=False)
    return request


def test_a_move_cuts_a_stream_waiting_on_its_engine_at_once_and_is_told_apart_as_replica_leaving():
    async def scenario():
        tasks = BackgroundTasks()
        in_flight = InFlight(tasks, first_byte_timeout=5, idle_timeout=5)
        got = []

        async def relay():
            exchange = in_flight.begin("k", never_leaves)
            got.append(exchange)
            exchange.start_next_chunk_deadline()
            try:
                await asyncio.sleep(10)  # reading the engine's next chunk
            except asyncio.CancelledError as exc:
                return exchange.failure(exc), asyncio.current_task().cancelling()
            finally:
                in_flight.end(exchange)

        task = asyncio.ensure_future(relay())
        await asyncio.sleep(0.01)
        got[0].move()
        try:
            return await asyncio.wait_for(task, 1)
        finally:
            await tasks.cancel_all()

    failure, cancelling = asyncio.run(scenario())
    assert isinstance(failure, ReplicaLeaving) and cancelling == 0


def test_a_stream_moved_while_it_sends_is_cut_by_the_sweep_once_it_waits_on_its_engine_again():
    async def scenario():
        tasks = BackgroundTasks()
        in_flight = InFlight(tasks, first_byte_timeout=5, idle_timeout=5)
        loop = asyncio.get_running_loop()
        marks = {}

        async def relay():
            exchange = in_flight.begin("k", never_leaves)
            exchange.stop_deadline()  # sending a chunk to the client
            exchange.move()
            await asyncio.sleep(3 * in_flight.period)  # a slow client: never cut while sending
            marks["sent"] = loop.time()
            exchange.start_next_chunk_deadline()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError as exc:
                marks["cut"] = loop.time()
                return exchange.failure(exc)
            finally:
                in_flight.end(exchange)

        try:
            return await asyncio.wait_for(relay(), 2), marks, in_flight.period
        finally:
            await tasks.cancel_all()

    failure, marks, period = asyncio.run(scenario())
    assert isinstance(failure, ReplicaLeaving)
    assert 0 <= marks["cut"] - marks["sent"] <= 2 * period + 0.1


def test_a_passed_deadline_is_still_the_engines_failure_and_a_moves_cut_is_replica_leaving():
    exchange = Exchange("k", never_leaves, None)
    exchange.overdue = "next chunk"
    cancelled = asyncio.CancelledError()
    assert exchange.failure(cancelled) is cancelled  # the sweep's cut for silence: the error it always was
    assert exchange.failure(cancelled) is None  # taken back once: any other cancellation is not the engine's
    error = ConnectionResetError()
    assert exchange.failure(error) is error
    exchange.overdue = MOVE
    assert isinstance(exchange.failure(cancelled), ReplicaLeaving)


def test_a_move_finds_only_the_streams_still_relayed_from_its_replica():
    async def scenario():
        moves = StreamMoves()
        on_one, on_two, ended = stream({"messages": []}), stream({"messages": []}), stream({"messages": []})
        moves.streams.update({on_one: "1", on_two: "2", ended: "1"})
        moves.streams.pop(ended)  # its leg ended, as the relay ends it
        return moves.move("1"), on_one.exchange.moving, on_two.exchange.moving, ended.exchange.moving

    assert asyncio.run(scenario()) == (1, True, False, False)


def test_only_streams_that_would_be_continued_are_moved():
    plain = stream({"messages": [], "stream": True})
    guided = stream({"messages": [], "stream": True, "response_format": {"type": "json_object"}})
    spent = stream({"messages": [], "stream": True})
    spent.transcript.fruitless = 2
    tool = stream({"messages": [], "stream": True, "tools": [{"type": "function"}]})
    tool.transcript.kept.append(
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"f"}}]}}]}\n\n'
    )
    # A stream that used its LLMGW_STREAM_MIGRATIONS on failing engines still moves: a drain is no failure.
    assert [may_move(r) for r in (plain, guided, spent, tool)] == [True, False, True, False]
    assert tool.transcript.answer is None and len(tool.transcript.kept) == 1  # looked at, not taken


def test_moves_happen_at_the_tables_time_and_are_dropped_with_it():
    async def scenario():
        now = asyncio.get_running_loop().time
        moves = StreamMoves(clock=lambda: 1000.0)
        first, second = stream({"messages": []}), stream({"messages": []})
        moves.streams.update({first: "1", second: "2"})
        moves.plan({"1": 1000.1, "2": 1000.1})
        moves.plan({"1": 1000.1})  # replica 2 is back in service (or gone): its move is dropped
        began = now()
        await asyncio.sleep(0.05)
        early = first.exchange.moving
        await asyncio.sleep(0.1)
        late = first.exchange.moving, second.exchange.moving
        # A stream that begins on a replica whose time has come moves at once.
        third = stream({"messages": []})
        moves.streams[third] = "1"
        moves.begun_on_due("1", third)
        return early, late, third.exchange.moving, now() - began

    early, late, third, _ = asyncio.run(scenario())
    assert early is False and late == (True, False) and third is True


def test_a_replicas_streams_move_in_batches_each_judged_when_its_turn_comes(monkeypatch):
    monkeypatch.setattr(moves_module, "MOVE_BATCH", 2)

    async def scenario():
        moves = StreamMoves()
        streams = [stream({"messages": []}) for _ in range(5)]
        moves.streams.update(dict.fromkeys(streams, "1"))
        at_once = moves.move("1")
        moving_at_once = sum(r.exchange.moving for r in streams)
        moves.streams.pop(streams[0])  # it ended before its turn: not moved
        await asyncio.sleep(10 * moves_module.MOVE_PAUSE_SECONDS)
        return at_once, moving_at_once, [r.exchange.moving for r in streams]

    at_once, moving_at_once, moving = asyncio.run(scenario())
    assert (at_once, moving_at_once) == (2, 2)
    assert moving == [False, True, True, True, True]  # popped last-first: the first in the list went last
