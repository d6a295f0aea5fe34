"""`manage.py enrol_node --print-command`: a command line the agent's own parser accepts, with the real token."""

import argparse
import shlex
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from agent import cli
from inventory.models import Node, NodeCredential

pytestmark = pytest.mark.django_db


def enrol(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("enrol_node", *args, stdout=out, stderr=err)
    return out.getvalue().strip(), err.getvalue()


def agent_options(command: str) -> dict:
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "agent"]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return vars(parser.parse_args(argv[3:]))


def test_printed_command_parses_with_the_agents_parser_and_carries_a_working_token():
    command, _ = enrol(
        "gpu-017", "--fabric", "ib-a", "--address", "10.1.0.17", "--print-command",
        "--control-plane", "wss://cp1:8443/agent/ws", "--control-plane", "wss://cp2:8443/agent/ws",
        "--ca-file", "/etc/llmgw/ca.pem",
    )  # fmt: skip
    options = agent_options(command)
    assert options["control_planes"] == ["wss://cp1:8443/agent/ws", "wss://cp2:8443/agent/ws"]
    assert (options["node"], options["fabric"], options["address"]) == ("gpu-017", "ib-a", "10.1.0.17")
    assert options["ca_file"] == "/etc/llmgw/ca.pem"
    assert NodeCredential.objects.verify("gpu-017", options["token"]) is not None


def test_control_planes_and_ca_come_from_settings_and_ws_gets_no_ca_file(settings):
    settings.LLMGW_AGENT_CONTROL_PLANES = ["ws://cp1:8000/agent/ws"]
    settings.LLMGW_AGENT_CA_FILE = "/etc/llmgw/ca.pem"
    options = agent_options(enrol("gpu-1", "--print-command")[0])
    assert options["control_planes"] == ["ws://cp1:8000/agent/ws"] and options["ca_file"] is None

    settings.LLMGW_AGENT_CONTROL_PLANES = ["wss://cp1:8443/agent/ws"]
    settings.LLMGW_TLS_CLIENT_CA_FILE = "/etc/llmgw/nodes-ca.pem"
    command, err = enrol("gpu-2", "--print-command")
    assert agent_options(command)["ca_file"] == "/etc/llmgw/ca.pem"
    assert "--cert-file and --key-file" in err and "CN is “gpu-2”" in err


def test_without_print_command_stdout_is_the_token_alone():
    token, _ = enrol("gpu-3")
    assert token.startswith("llmgw-node-") and " " not in token


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["--print-command"], "give --control-plane"),
        (["--print-command", "--control-plane", "http://cp/agent/ws"], "must be a ws:// or wss:// URL"),
        (["--control-plane", "ws://cp/agent/ws"], "go with --print-command"),
    ],
)
def test_bad_print_command_options_enrol_nothing(args, problem, settings):
    settings.LLMGW_AGENT_CONTROL_PLANES = []
    with pytest.raises(CommandError, match=problem):
        enrol("gpu-4", *args)
    assert not Node.objects.filter(name="gpu-4").exists()
