"""The agent's state directory: the highest epoch survives a restart, and a directory serves one node only."""

import argparse
import asyncio
import contextlib
import json
import logging
import shutil

import pytest

from agent import cli
from agent.state import STATE_FILE, AgentState, StateError, default_state_dir
from agent.tests.stand_ins import NODE, ControlPlane, command, make_agent, run
from nodewire import protocol


@contextlib.asynccontextmanager
async def greeted(state_dir):
    """A control plane and an agent on `state_dir` that has said hello; the agent is shut down after."""
    async with ControlPlane() as cp:
        agent = make_agent([cp.url], state_dir=state_dir)
        task = asyncio.create_task(agent.run())
        await cp.next(protocol.HELLO)
        yield cp, agent
        await agent.shutdown()
        await task


def test_restarted_agent_refuses_an_epoch_older_than_one_seen_before_the_restart(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="agent.state")
    state_dir = tmp_path / "state"

    async def scenario():
        async with greeted(state_dir) as (cp, _):
            await cp.send(command(protocol.STOP_SHARD, 5, shard_id=1))
            assert (await cp.next(protocol.SHARD_STATUS))["shard_id"] == 1

        # A new process (a new Agent) on the same state directory.
        async with greeted(state_dir) as (cp, agent):
            assert agent.highest_epoch == 5
            await cp.send(command(protocol.STOP_SHARD, 4, shard_id=2))
            # The current leader's command is answered; the stale one never is.
            await cp.send(command(protocol.STOP_SHARD, 5, shard_id=3))
            assert (await cp.next(protocol.SHARD_STATUS))["shard_id"] == 3

    run(scenario())
    assert "epoch 4 is older than epoch 5 already seen (remembered in " in caplog.text
    assert "remove it if the control plane's database was replaced" in caplog.text
    assert json.loads((state_dir / STATE_FILE).read_text()) == {"version": 1, "node": NODE, "highest_epoch": 5}


def test_epoch_is_written_atomically_before_the_command_is_carried_out(tmp_path):
    state = AgentState.open(tmp_path, "gpu-1")
    assert state.highest_epoch is None
    state.record_epoch(7)
    # Only the state file is left: the temp file was renamed over it.
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]
    assert AgentState.open(tmp_path, "gpu-1").highest_epoch == 7


def test_a_newer_epoch_that_cannot_be_recorded_is_refused(tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="agent.state")
    state_dir = tmp_path / "state"

    async def scenario():
        async with greeted(state_dir) as (cp, agent):
            # The directory vanishes under the agent (a disk replaced, a wrong mount).
            shutil.rmtree(state_dir)
            state_dir.write_text("not a directory")
            await cp.send(command(protocol.STOP_SHARD, 3, shard_id=1))
            with pytest.raises(TimeoutError):
                await cp.next(protocol.SHARD_STATUS, timeout=0.5)
            assert agent.highest_epoch is None

    run(scenario())
    assert "epoch 3 cannot be recorded" in caplog.text and "cannot write the agent state file" in caplog.text


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("{not json", "is not valid JSON"),
        ('{"version": 1, "node": "gpu-1", "highest_epoch": "5"}', "bad highest_epoch '5'"),
        ('{"version": 1, "highest_epoch": 5}', "names no node"),
        ("[]", "is not a version 1 agent state"),
    ],
)
def test_corrupt_state_file_is_a_clear_error(tmp_path, text, problem):
    (tmp_path / STATE_FILE).write_text(text)
    with pytest.raises(StateError, match=problem) as caught:
        AgentState.open(tmp_path, "gpu-1")
    assert str(tmp_path / STATE_FILE) in str(caught.value)


def test_state_directory_of_another_node_is_refused(tmp_path):
    AgentState.open(tmp_path, "gpu-1").record_epoch(2)
    with pytest.raises(StateError, match="belongs to node “gpu-1”, not “gpu-2”"):
        AgentState.open(tmp_path, "gpu-2")


def test_agent_command_refuses_a_state_directory_of_another_node(tmp_path, capsys):
    AgentState.open(tmp_path, "gpu-1")
    args = ["--control-plane", "ws://127.0.0.1:9/agent/ws", "--node", "gpu-2", "--token", "t"]
    assert cli.main([*args, "--fake-gpus", "1xL4-24GB", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "belongs to node “gpu-1”, not “gpu-2”" in err and "--state-dir" in err


def test_agent_command_takes_the_state_directory_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMGW_AGENT_STATE_DIR", str(tmp_path / "from-env"))
    args = ["--control-plane", "ws://127.0.0.1:9/agent/ws", "--node", "gpu-3", "--token", "t"]
    options = vars(_parser().parse_args([*args, "--fake-gpus", "1xL4-24GB"]))
    cli.agent_from_options(options, 5.0)
    assert json.loads((tmp_path / "from-env" / STATE_FILE).read_text())["node"] == "gpu-3"


def test_default_state_directory_is_the_system_one_for_root_and_the_users_otherwise():
    assert default_state_dir({}, is_root=True) == "/var/lib/llmgw-agent"
    assert default_state_dir({"XDG_STATE_HOME": "/home/a/.state"}, is_root=False) == "/home/a/.state/llmgw-agent"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser
