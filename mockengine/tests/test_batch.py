"""The mock engine's batch (mockengine/batch.py): `--max-num-seqs` bounds what runs, the rest wait in its own queue,
first come first served or by priority."""

import asyncio

import pytest

from mockengine.batch import MockBatch
from mockengine.server import parse_args


def test_without_a_bound_everything_runs_at_once():
    async def go():
        batch = MockBatch()
        for _ in range(100):
            await batch.enter()
        return batch.running, batch.waiting

    assert asyncio.run(go()) == (100, 0)


@pytest.mark.parametrize("by_priority, expected", [(False, [5, 0, 3]), (True, [0, 3, 5])])
def test_the_waiting_run_in_arrival_order_or_by_priority_as_places_free(by_priority, expected):
    async def go():
        batch, started = MockBatch(max_num_seqs=1, by_priority=by_priority), []
        await batch.enter()

        async def one(priority):
            await batch.enter(priority)
            started.append(priority)

        tasks = [asyncio.create_task(one(p)) for p in (5, 0, 3)]
        await asyncio.sleep(0)
        assert (batch.running, batch.waiting) == (1, 3)
        for _ in range(3):
            batch.leave()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return started

    assert asyncio.run(go()) == expected


def test_a_request_that_leaves_while_waiting_neither_runs_nor_holds_a_place():
    async def go():
        batch = MockBatch(max_num_seqs=1)
        await batch.enter()
        gone = asyncio.create_task(batch.enter())
        stays = asyncio.create_task(batch.enter())
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert batch.waiting == 1
        batch.leave()
        await stays
        batch.leave()
        return batch.running, batch.waiting

    assert asyncio.run(go()) == (0, 0)


def test_the_flags_are_read_and_a_bad_bound_refused(capsys):
    args = parse_args(["--port", "1", "--model", "m", "--max-num-seqs", "4", "--scheduling-policy", "priority"])
    assert (args.max_num_seqs, args.scheduling_policy) == (4, "priority")
    with pytest.raises(SystemExit):
        parse_args(["--port", "1", "--model", "m", "--max-num-seqs", "0"])
    assert "--max-num-seqs" in capsys.readouterr().err


def test_with_a_slowdown_each_token_takes_longer_the_more_requests_run_beside_it():
    async def go():
        batch = MockBatch(slowdown=0.25)
        steps = []
        for _ in range(3):
            await batch.enter()
            steps.append(batch.step(0.04))
        return steps

    assert asyncio.run(go()) == pytest.approx([0.04, 0.05, 0.06])
    assert MockBatch().step(0.04) == 0.04


def test_a_bad_batch_slowdown_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--port", "9000", "--model", "m", "--batch-slowdown", "fast"])
    assert "the batch slowdown must be a number, got 'fast'" in capsys.readouterr().err
    assert parse_args(["--port", "9000", "--model", "m", "--batch-slowdown", "0.5"]).batch_slowdown == 0.5
