"""`manage.py agent`: argument checking, rejection, and a clean stop on SIGTERM."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from http import HTTPStatus
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from websockets.sync.server import serve

PROJECT = Path(__file__).resolve().parents[2]


class ThreadedControlPlane:
    """A stand-in /agent/ws served from a thread, for commands that run their own event loop."""

    def __init__(self, reject_status: int | None = None):
        self.reject_status = reject_status
        self.messages: queue.Queue = queue.Queue()

    def __enter__(self):
        self.server = serve(self._handler, "127.0.0.1", 0, process_request=self._process_request)
        self.url = f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/agent/ws"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.thread.join(5)

    def _process_request(self, connection, request):
        if self.reject_status is not None:
            return connection.respond(self.reject_status, "refused\n")
        return None

    def _handler(self, ws):
        try:
            for raw in ws:
                self.messages.put(json.loads(raw))
        except Exception:
            pass


def agent(*args):
    out = StringIO()
    call_command("agent", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch):
    monkeypatch.delenv("LLMGW_NODE_TOKEN", raising=False)


CP = "ws://127.0.0.1:9/agent/ws"


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--node", "n1", "--token", "t"], "at least one --control-plane"),
        (["--control-plane", "http://cp/agent/ws", "--node", "n1", "--token", "t"], "must be a ws:// or wss:// URL"),
        (["--control-plane", CP, "--node", "bad name!", "--token", "t"], "Node name 'bad name!'"),
        (["--control-plane", CP, "--node", "n1"], "--token or the LLMGW_NODE_TOKEN"),
        (["--control-plane", CP, "--node", "n1", "--token", "t", "--label", "rack"], "Label 'rack' is not key=value"),
        (["--control-plane", CP, "--node", "n1", "--token", "t", "--fake-gpus", "8xH100"], "Cannot discover GPUs"),
        (["--control-plane", CP, "--node", "n1", "--token", "t", "--heartbeat-seconds", "0"], "must be positive"),
    ],
)
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
            assert (hello["type"], hello["node"], hello["fabric"], hello["labels"]) == ("hello", "n2", "ib-a", {"rack": "r1"})
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=10)
        finally:
            process.kill()
        assert process.returncode == 0, output
        assert "agent for node n2 stopped" in output
