"""`manage.py up` refuses bad arguments with one clear sentence, before serving anything."""

import socket

import pytest
from django.core.management import CommandError, call_command

from conftest import free_port

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "args, message",
    [
        (["--port", "eighty"], "port 'eighty' is not a number"),
        (["--router-port", "70000"], "port 70000 is outside 1-65535"),
        (["--port", "9100", "--router-port", "9100"], "--port and --router-port must differ"),
    ],
)
def test_bad_ports_are_refused(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("up", *args)


def test_a_port_in_use_is_named():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(CommandError, match=f"cannot listen on 127.0.0.1:{port}"):
            call_command("up", "--host", "127.0.0.1", "--port", str(port), "--router-port", str(free_port()))


def test_a_host_outside_allowed_hosts_is_refused_with_the_fix(settings):
    """Settings are never patched at run time: `up --host` names the variable to set instead."""
    settings.ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
    with pytest.raises(CommandError, match="host 10.9.8.7 is not in ALLOWED_HOSTS .*LLMGW_HOST=10.9.8.7"):
        # Refused before anything listens: the ports need only differ (two free_port() calls may not).
        call_command("up", "--host", "10.9.8.7", "--port", "18001", "--router-port", "18002")
    assert settings.ALLOWED_HOSTS == ["127.0.0.1", "localhost"]
