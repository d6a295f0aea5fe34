"""Building llama-server into the cache: where it goes, reuse of a finished binary, and clear refusals.

The build itself (minutes of C++) is exercised by `make llama-server` and the
real-engine test; these tests run stand-in binaries (small shell scripts) in a
cache of their own, so they take milliseconds.
"""

import io
import os
import stat
import tarfile
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from runner.llama_server import BuildError, BuildPlace, build_llama_server, build_place, cache_root, missing_build_tools


def stand_in(path: Path, script: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + script + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_cache_is_under_xdg_cache_home_else_the_home_directory(tmp_path):
    assert cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "llmgw"
    assert cache_root({}) == Path.home() / ".cache" / "llmgw"
    place = build_place("0.3.36", {"XDG_CACHE_HOME": str(tmp_path)})
    assert place.binary == tmp_path / "llmgw" / "llama-server-0.3.36" / "bin" / "llama-server"


def test_missing_build_tools_are_named():
    assert missing_build_tools(lambda name: f"/usr/bin/{name}") == []
    assert missing_build_tools(lambda name: None) == [
        "cmake",
        "a C++ compiler (g++)",
        "a C compiler (gcc)",
        "ninja or make",
    ]
    only_make = {"cmake", "g++", "gcc", "make"}
    assert missing_build_tools(lambda name: name if name in only_make else None) == []


def test_a_cached_binary_is_reused_without_building(tmp_path, monkeypatch):
    place = BuildPlace(tmp_path / "llama-server-0.3.36")
    stand_in(place.binary, 'echo "version: 1 (stand-in)"')
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no cmake, no compiler: a build would be refused
    assert build_llama_server(place=place, progress=lambda line: pytest.fail(line)) == place.binary


def test_a_cached_binary_that_does_not_run_is_an_error_not_a_success(tmp_path):
    place = BuildPlace(tmp_path / "llama-server-0.3.36")
    stand_in(place.binary, "echo broken >&2; exit 3")
    with pytest.raises(BuildError, match="--version failed \\(3\\): broken"):
        build_llama_server(place=place)


def test_without_build_tools_the_build_is_refused_naming_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    place = BuildPlace(tmp_path / "llama-server-0.3.36")
    with pytest.raises(BuildError, match="cannot build llama-server: cmake, a C\\+\\+ compiler"):
        build_llama_server(place=place)
    assert not place.root.exists(), "nothing is half-written"


def test_a_failing_build_step_quotes_its_log(tmp_path, monkeypatch):
    tools = tmp_path / "tools"
    for name in ("g++", "gcc", "make"):
        stand_in(tools / name, "exit 0")
    stand_in(tools / "cmake", "echo 'CMake Error: no compiler works' ; exit 1")
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin")
    place = BuildPlace(tmp_path / "llama-server-0.3.36")
    # A source tree as the sdist would have left it, so the build goes straight to cmake.
    source = place.root / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("")
    with pytest.raises(BuildError, match="cmake configure failed with exit code 1") as failure:
        build_llama_server("0.3.36", place=place, progress=lambda line: None)
    assert "CMake Error: no compiler works" in str(failure.value)
    assert not place.binary.exists()


def test_command_prints_the_cached_binary_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    binary = stand_in(tmp_path / "llmgw" / "llama-server-0.3.36" / "bin" / "llama-server", "echo version")
    out = StringIO()
    call_command("build_llama_server", "--release", "0.3.36", stdout=out, stderr=StringIO())
    assert out.getvalue().strip() == str(binary)


@pytest.mark.parametrize(
    ("args", "problem"),
    [(["--jobs", "0"], "--jobs must be at least 1"), (["--release", "latest"], "--release must look like")],
)
def test_command_refuses_bad_arguments(args, problem):
    with pytest.raises(CommandError, match=problem):
        call_command("build_llama_server", *args, stdout=StringIO(), stderr=StringIO())


def sdist(place: BuildPlace, version: str, members: dict[str, str]) -> None:
    """A source distribution in the download folder, as pip would have left it."""
    (place.root / "dl").mkdir(parents=True)
    with tarfile.open(place.root / "dl" / f"llama_cpp_python-{version}.tar.gz", "w:gz") as archive:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


@pytest.fixture
def stand_in_toolchain(tmp_path, monkeypatch):
    """cmake that 'builds' a stand-in llama-server and logs each call; compilers that exist."""
    tools = tmp_path / "tools"
    calls = tmp_path / "cmake-calls"
    for name in ("g++", "gcc", "make"):
        stand_in(tools / name, "exit 0")
    stand_in(
        tools / "cmake",
        f'echo "$*" >> {calls}\n'
        'if [ "$1" = "--build" ]; then mkdir -p "$2/bin"; '
        "printf '#!/bin/sh\\necho version: stand-in\\n' > \"$2/bin/llama-server\"; "
        'chmod +x "$2/bin/llama-server"; fi',
    )
    monkeypatch.setenv("PATH", f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin")
    return calls


def test_a_build_extracts_the_vendored_tree_configures_builds_and_caches_the_binary(tmp_path, stand_in_toolchain):
    place = BuildPlace(tmp_path / "cache" / "llama-server-9.9.9")
    sdist(place, "9.9.9", {"llama_cpp_python-9.9.9/vendor/llama.cpp/CMakeLists.txt": "project(llama.cpp)"})
    lines: list[str] = []
    binary = build_llama_server("9.9.9", place=place, jobs=3, progress=lines.append)
    assert binary == place.binary and binary.is_file()
    configure, build = stand_in_toolchain.read_text().splitlines()
    assert configure.startswith(f"-S {place.root}/src/llama_cpp_python-9.9.9/vendor/llama.cpp -B {place.root}/build")
    assert "-DGGML_NATIVE=OFF" in configure and "-DLLAMA_CURL=OFF" in configure
    assert build == f"--build {place.root}/build --target llama-server -j 3"
    assert "built in" in place.info.read_text() and lines[-1].startswith(f"built {binary}")
    assert not (place.root / "src.partial").exists() and not binary.with_suffix(".partial").exists()

    # Built once: the next call returns the cached binary without running cmake.
    assert build_llama_server("9.9.9", place=place, progress=lines.append) == binary
    assert len(stand_in_toolchain.read_text().splitlines()) == 2


def test_an_sdist_that_escapes_its_folder_is_refused(tmp_path, stand_in_toolchain):
    place = BuildPlace(tmp_path / "cache" / "llama-server-9.9.9")
    sdist(place, "9.9.9", {"../../escaped.txt": "x"})
    with pytest.raises(BuildError, match="cannot extract .*llama_cpp_python-9.9.9.tar.gz"):
        build_llama_server("9.9.9", place=place, progress=lambda line: None)
    assert not (tmp_path / "escaped.txt").exists() and not (place.root / "src.partial").exists()
    assert not stand_in_toolchain.exists(), "cmake never ran"
