"""`manage.py agent`: argument checking, rejection, and a clean stop on SIGTERM."""

import os
import signal
import subprocess
import sys
from http import HTTPStatus
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from agent.tests.stand_ins import BAD_ARGUMENTS, ThreadedControlPlane

PROJECT = Path(__file__).resolve().parents[2]


def agent(*args):
    out = StringIO()
    call_command("agent", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch):
    monkeypatch.delenv("LLMGW_NODE_TOKEN", raising=False)


@pytest.mark.parametrize(("args", "problem"), BAD_ARGUMENTS)
def test_bad_arguments_raise_command_error_naming_the_problem(args, problem):
    if "--fake-gpus" not in args:
        args = [*args, "--fake-gpus", "1xL4-24GB"]  # so no test depends on this machine's nvidia-smi
    with pytest.raises(CommandError, match=problem):
        agent(*args)


def test_rejected_credential_from_env_becomes_command_error(monkeypatch):
    monkeypatch.setenv("LLMGW_NODE_TOKEN", "llmgw-node-wrong")
    refused = "refused node “n1” \\(HTTP 403\\)"
    with ThreadedControlPlane(reject_status=HTTPStatus.FORBIDDEN) as cp, pytest.raises(CommandError, match=refused):
        agent("--control-plane", cp.url, "--node", "n1", "--fake-gpus", "2xL40S-48GB", "--address", "127.0.0.1")


def test_sigterm_stops_the_agent_cleanly():
    with ThreadedControlPlane() as cp:
        process = subprocess.Popen(
            [
                sys.executable, "manage.py", "agent", "--control-plane", cp.url, "--node", "n2",
                "--fake-gpus", "1xL4-24GB", "--address", "127.0.0.1", "--label", "rack=r1", "--fabric", "ib-a",
            ],
            cwd=PROJECT,
            env={**os.environ, "LLMGW_NODE_TOKEN": "llmgw-node-t"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        try:
            hello = cp.messages.get(timeout=10)
            assert (hello["type"], hello["node"], hello["fabric"], hello["labels"]) == (
                "hello",
                "n2",
                "ib-a",
                {"rack": "r1"},
            )
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=10)
        finally:
            process.kill()
        assert process.returncode == 0, output
        assert "agent for node n2 stopped" in output
