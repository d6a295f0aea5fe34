"""The `llmgw` command (llmgw.cli): every process and operator task listed, each subcommand's own --help, a bad
command line refused with exit code 2 and a message naming the problem, the node agent run without Django, and
the API keys managed from the command line."""

import subprocess
import sys

import pytest
from django.core.management import get_commands

from keys.models import ApiKey
from llmgw.cli import SUBCOMMANDS, main, parser
from llmgw.healthcheck import role_and_port
from tests.test_layers import ROOT


def test_the_help_lists_every_process_and_operator_task(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    listed = capsys.readouterr().out
    for name in (
        "up",
        "server",
        "router",
        "worker",
        "beat",
        "agent",
        "migrate",
        "createsuperuser",
        "status",
        "plan",
        "catalog",
        "keys",
        "showback",
        "manage",
    ):
        assert f"\n    {name} " in listed or f"\n    {name}\n" in listed, name
    assert set(SUBCOMMANDS) <= set(parser()._subparsers._group_actions[0].choices)  # type: ignore[union-attr]


def test_every_subcommand_runs_a_command_that_exists():
    commands = get_commands()
    assert {sub.django for sub in SUBCOMMANDS.values() if sub.django} <= set(commands)


@pytest.mark.parametrize("name", [name for name in SUBCOMMANDS if name != "manage"])
def test_every_subcommand_has_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: llmgw {name} ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bogus"], "invalid choice: 'bogus'"),
        (["status", "--bogus"], "llmgw status: error: unrecognized arguments: --bogus"),
        (["keys"], "llmgw keys: error: the following arguments are required"),
        (["server", "--port", "0"], "llmgw server: error: --port 0: give a port between 1 and 65535"),
        (["plan"], "llmgw plan: error: give a catalog file"),
        (["manage", "nosuchcommand"], "llmgw manage nosuchcommand: error: no such command"),
        (["agent"], "llmgw agent: error: the following arguments are required: --node"),
    ],
)
@pytest.mark.django_db
def test_a_bad_command_line_exits_2_naming_the_problem(argv, message, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_the_agent_runs_without_importing_django():
    script = (
        "import sys\nfrom llmgw.cli import main\ntry:\n    main(['agent', '--help'])\nexcept SystemExit:\n    pass\n"
    )
    script += "print('django' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("False")


@pytest.mark.django_db
def test_keys_are_created_listed_and_revoked_by_prefix(capsys):
    assert main(["keys", "create", "team-a", "--rpm", "60"]) == 0
    secret = capsys.readouterr().out.strip().splitlines()[-1]
    key = ApiKey.objects.get(name="team-a")
    assert secret.startswith(key.prefix) and key.rpm == 60
    assert main(["keys", "list"]) == 0
    assert f"{key.prefix}\tactive\tnever\trpm=60 tpm=-\tteam-a" in capsys.readouterr().out
    assert main(["keys", "revoke", key.prefix, "nope-no-such-key"]) == 2
    assert "no key starts with 'nope-no-such-key' (nothing revoked)" in capsys.readouterr().err
    assert ApiKey.objects.get(pk=key.pk).active  # nothing half done
    assert main(["keys", "revoke", key.prefix]) == 0
    assert not ApiKey.objects.get(pk=key.pk).active


@pytest.mark.parametrize(
    "argv, found",
    [
        (["/opt/llmgw/bin/python3", "/opt/llmgw/bin/llmgw", "server", "--host", "0.0.0.0"], ("server", 8000)),
        (["llmgw", "router", "--port", "9090"], ("router", 9090)),
        (["llmgw", "router", "--port=9091"], ("router", 9091)),
        (["llmgw", "up", "--demo"], ("up", 8000)),
        (["llmgw", "worker"], ("worker", None)),
        (["llmgw", "agent", "--node", "n1", "--port", "1"], ("agent", None)),
        (["sh", "-c", "sleep 1"], ("", None)),
    ],
)
def test_the_images_healthcheck_probes_what_the_containers_command_serves(argv, found, monkeypatch):
    monkeypatch.delenv("LLMGW_PORT", raising=False)
    assert role_and_port(argv) == found
    monkeypatch.setenv("LLMGW_PORT", "8100")
    assert role_and_port(["llmgw", "up"]) == ("up", 8100)
