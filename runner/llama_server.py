"""Build llama.cpp's `llama-server` from source, once, into a cache outside the checkout.

The source is the llama.cpp tree vendored in the `llama-cpp-python` source
distribution on PyPI (`vendor/llama.cpp`, with `tools/server`), fetched with
pip, so a machine that reaches only package registries can build it. Only the
`llama-server` target is built: CPU only, portable (`GGML_NATIVE=OFF`, so a
cached binary runs on any x86-64 of the same OS), statically linked to
llama.cpp's own libraries, no curl, no OpenSSL, no web UI download.

Layout under `$XDG_CACHE_HOME/llmgw/llama-server-<version>/` (default
`~/.cache/llmgw/…`): `dl/` the sdist, `src/` its vendored llama.cpp, `build/`
the CMake tree (kept, so an interrupted build resumes), `bin/llama-server`
the result, `build-info.txt` the flags and how long it took. A finished binary
is reused as is; building again needs `--force` (or deleting the directory).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

# The llama-cpp-python release whose vendored llama.cpp is built (and whose flags agent/engines/launch.py uses).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BINARY_NAME = "llama-server"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
)
# Lines of the build log quoted in an error.
LOG_TAIL_LINES = 30


class BuildError(Exception):
    """The build could not be done; the message says why and what to do."""


@dataclass(frozen=True)
class BuildPlace:
    """Where one version's download, source, build tree and binary live."""

    root: Path

    @property
    def binary(self) -> Path:
        return self.root / "bin" / BINARY_NAME

    @property
    def info(self) -> Path:
        return self.root / "build-info.txt"

    @property
    def log(self) -> Path:
        return self.root / "build.log"


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """`$XDG_CACHE_HOME/llmgw`, or `~/.cache/llmgw`."""
    base = environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "llmgw"


def build_place(version: str = LLAMA_CPP_PYTHON_VERSION, environ: Mapping[str, str] = os.environ) -> BuildPlace:
    return BuildPlace(cache_root(environ) / f"llama-server-{version}")


def missing_build_tools(which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """The tools a build needs that are not on PATH (empty when it can run)."""
    missing = []
    if which("cmake") is None:
        missing.append("cmake")
    if which("c++") is None and which("g++") is None and which("clang++") is None:
        missing.append("a C++ compiler (g++)")
    if which("cc") is None and which("gcc") is None and which("clang") is None:
        missing.append("a C compiler (gcc)")
    if which("ninja") is None and which("make") is None:
        missing.append("ninja or make")
    return missing


def build_llama_server(
    version: str = LLAMA_CPP_PYTHON_VERSION,
    *,
    place: BuildPlace | None = None,
    jobs: int | None = None,
    force: bool = False,
    progress: Callable[[str], None] = print,
) -> Path:
    """The path of a working `llama-server` of `version`, built first unless the cache has it."""
    place = place or build_place(version)
    if place.binary.is_file() and not force:
        _check_runs(place.binary)
        return place.binary
    missing = missing_build_tools()
    if missing:
        raise BuildError(f"cannot build {BINARY_NAME}: {', '.join(missing)} not found (apt-get install cmake g++)")
    place.root.mkdir(parents=True, exist_ok=True)
    # Two builds of one version at once (CI beside a developer) would share a build tree: one waits.
    with open(place.root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if place.binary.is_file() and not force:
            return place.binary
        started = time.monotonic()
        source = _source_tree(version, place, progress)
        _compile(source, place, jobs or os.cpu_count() or 1, progress)
        seconds = time.monotonic() - started
        _check_runs(place.binary)
        place.info.write_text(
            f"llama-cpp-python {version} (vendor/llama.cpp), target {BINARY_NAME}\n"
            f"cmake {' '.join(CMAKE_FLAGS)}\n"
            f"built in {seconds:.0f} s with {jobs or os.cpu_count()} jobs\n"
        )
        progress(f"built {place.binary} in {seconds:.0f} s")
    return place.binary


def _source_tree(version: str, place: BuildPlace, progress: Callable[[str], None]) -> Path:
    """llama.cpp's source from the sdist, downloaded with pip and extracted once."""
    source = place.root / "src" / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    download = place.root / "dl"
    sdists = sorted(download.glob(f"llama_cpp_python-{version}.tar.gz"))
    if not sdists:
        progress(f"downloading the llama-cpp-python {version} source distribution with pip")
        _run(
            [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}"]
            + ["--no-binary", ":all:", "--no-deps", "-d", str(download)],
            place,
            "pip download",
        )
        sdists = sorted(download.glob(f"llama_cpp_python-{version}.tar.gz"))
        if not sdists:
            raise BuildError(f"pip downloaded no llama_cpp_python-{version}.tar.gz into {download}")
    progress(f"extracting {sdists[0].name}")
    # Extracted aside and renamed, so an interrupted extraction never passes for a source tree.
    partial = place.root / "src.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with tarfile.open(sdists[0]) as archive:
            # The "data" filter refuses absolute paths, links out of the tree and device files.
            archive.extractall(partial, filter="data")
    except (tarfile.TarError, OSError) as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise BuildError(f"cannot extract {sdists[0]}: {exc}") from None
    shutil.rmtree(place.root / "src", ignore_errors=True)
    os.replace(partial, place.root / "src")
    if not (source / "CMakeLists.txt").is_file():
        raise BuildError(f"{sdists[0].name} holds no vendor/llama.cpp/CMakeLists.txt")
    return source


def _compile(source: Path, place: BuildPlace, jobs: int, progress: Callable[[str], None]) -> None:
    build = place.root / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    if not (build / "CMakeCache.txt").is_file():
        progress(f"configuring llama.cpp in {build}")
        _run(["cmake", "-S", str(source), "-B", str(build), *generator, *CMAKE_FLAGS], place, "cmake configure")
    progress(f"building {BINARY_NAME} with {jobs} jobs (log: {place.log})")
    _run(["cmake", "--build", str(build), "--target", BINARY_NAME, "-j", str(jobs)], place, "cmake build")
    built = build / "bin" / BINARY_NAME
    if not built.is_file():
        raise BuildError(f"the build finished but {built} is missing; see {place.log}")
    # Copied then renamed, so bin/ never holds half a binary.
    place.binary.parent.mkdir(exist_ok=True)
    partial = place.binary.with_suffix(".partial")
    shutil.copy2(built, partial)
    os.replace(partial, place.binary)


def _run(argv: list[str], place: BuildPlace, what: str) -> None:
    with open(place.log, "a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        tail = "\n".join(place.log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
        raise BuildError(f"{what} failed with exit code {code} (full log: {place.log}):\n{tail}")


def _check_runs(binary: Path) -> None:
    """A cached binary that no longer runs (wrong machine, truncated) is an error, not a silent skip."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise BuildError(f"{binary} does not run: {exc.strerror or exc}; rebuild with --force") from None
    if out.returncode != 0:
        raise BuildError(f"{binary} --version failed ({out.returncode}): {out.stderr.strip()[-500:]}")
