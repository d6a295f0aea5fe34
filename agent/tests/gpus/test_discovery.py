"""GPU discovery: fake specs and recorded nvidia-smi output."""

import sys
from pathlib import Path

import pytest

from agent.gpus.discovery import GPUDiscoveryError, discover_gpus, gpu_class_for, parse_fake_gpus, parse_nvidia_smi
from nodewire.protocol import to_builtins

DATA = Path(__file__).parents[1] / "data"


def test_fake_spec_gives_indexed_gpus_with_memory_from_the_class():
    gpus = parse_fake_gpus("8xH100-80GB", "gpu-01")
    assert [g.index for g in gpus] == list(range(8))
    assert {g.gpu_class for g in gpus} == {"H100-80GB"}
    assert {g.memory_mb for g in gpus} == {81920}
    assert all(g.healthy for g in gpus)
    assert len({g.uuid for g in gpus}) == 8


def test_fake_spec_with_several_groups_numbers_across_them():
    gpus = parse_fake_gpus("4xL40S-48GB, 2xA100-40GB", "gpu-02")
    assert [(g.index, g.gpu_class, g.memory_mb) for g in gpus] == [
        (0, "L40S-48GB", 49152),
        (1, "L40S-48GB", 49152),
        (2, "L40S-48GB", 49152),
        (3, "L40S-48GB", 49152),
        (4, "A100-40GB", 40960),
        (5, "A100-40GB", 40960),
    ]


def test_fake_uuids_are_stable_per_node_and_differ_between_nodes():
    assert parse_fake_gpus("2xH100-80GB", "a") == parse_fake_gpus("2xH100-80GB", "a")
    assert {g.uuid for g in parse_fake_gpus("2xH100-80GB", "a")}.isdisjoint(
        g.uuid for g in parse_fake_gpus("2xH100-80GB", "b")
    )


def test_gpu_message_has_the_protocol_shape():
    message = to_builtins(parse_fake_gpus("1xL4-24GB", "n")[0].report())
    assert set(message) == {"index", "uuid", "gpu_class", "memory_mb", "healthy", "reason"}
    assert message["gpu_class"] == "L4-24GB" and message["memory_mb"] == 24576


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("", "empty"),
        ("H100-80GB", "COUNTxCLASS-MEMGB"),
        ("8xH100", "COUNTxCLASS-MEMGB"),
        ("0xH100-80GB", "count of 0"),
        ("8xH100-80GB,", "''"),
        ("2x H100-80GB", "COUNTxCLASS-MEMGB"),
        ("65xH100-80GB", "more than 64"),
    ],
)
def test_bad_fake_spec_is_refused_naming_the_problem(spec, problem):
    with pytest.raises(ValueError, match=problem):
        parse_fake_gpus(spec, "n")


@pytest.mark.parametrize(
    ("filename", "count", "gpu_class", "memory_mb"),
    [
        ("nvidia_smi_8xH100.csv", 8, "H100-80GB", 81559),
        ("nvidia_smi_4xL40S.csv", 4, "L40S-48GB", 46068),
        ("nvidia_smi_2xA100_40GB.csv", 2, "A100-40GB", 40960),
    ],
)
def test_recorded_nvidia_smi_output_parses_to_marketed_classes(filename, count, gpu_class, memory_mb):
    gpus = parse_nvidia_smi((DATA / filename).read_text())
    assert [g.index for g in gpus] == list(range(count))
    assert {g.gpu_class for g in gpus} == {gpu_class}
    assert {g.memory_mb for g in gpus} == {memory_mb}
    assert all(g.uuid.startswith("GPU-") and g.healthy for g in gpus)


def test_gpu_with_unreadable_memory_is_reported_unhealthy_not_dropped():
    gpus = parse_nvidia_smi((DATA / "nvidia_smi_h100_one_faulty.csv").read_text())
    assert [(g.index, g.gpu_class, g.healthy) for g in gpus] == [
        (0, "H100-80GB", True),
        (1, "H100-80GB", False),
        (2, "H100-unknown", False),
    ]


@pytest.mark.parametrize(
    ("name", "memory_mb", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
        ("NVIDIA L40S", 46068, "L40S-48GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA H200", 143771, "H200-141GB"),
        ("NVIDIA H100 NVL", 95830, "H100-94GB"),
        ("NVIDIA L4", 23034, "L4-24GB"),
        ("Tesla T4", 15360, "T4-16GB"),
        ("NVIDIA RTX A6000", 49140, "RTXA6000-48GB"),
        ("NVIDIA GeForce RTX 4090", 24564, "RTX4090-24GB"),
    ],
)
def test_gpu_class_rounds_memory_to_the_marketed_size(name, memory_mb, expected):
    assert gpu_class_for(name, memory_mb) == expected


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("0, GPU-abc, NVIDIA L40S\n", "line 1 has 3 fields"),
        ("zero, GPU-abc, NVIDIA L40S, 46068\n", "index 'zero' is not an integer"),
        ("0, GPU-a, NVIDIA L40S, 46068\n0, GPU-b, NVIDIA L40S, 46068\n", "line 2: GPU index 0 appears twice"),
        ("0, 1234, NVIDIA L40S, 46068\n", "not a GPU uuid"),
        ("0, GPU-a, NVIDIA L40S, lots\n", "memory 'lots' is not a number"),
        ("0, GPU-a, NVIDIA, 46068\n", "names no product"),
    ],
)
def test_bad_nvidia_smi_output_is_refused_naming_the_line(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_nvidia_smi(text)


def test_blank_lines_in_nvidia_smi_output_are_ignored():
    assert len(parse_nvidia_smi("\n0, GPU-a, NVIDIA L40S, 46068\n\n")) == 1


def test_discovery_uses_the_fake_spec_when_given():
    assert discover_gpus("2xL40S-48GB", "n") == parse_fake_gpus("2xL40S-48GB", "n")


def test_discovery_without_nvidia_smi_says_so(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(GPUDiscoveryError, match="nvidia-smi was not found"):
        discover_gpus(None, "n")


def test_discovery_runs_nvidia_smi_from_path(monkeypatch, tmp_path):
    # A stand-in nvidia-smi that prints recorded output: the real argv path, without a GPU.
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!{sys.executable}\nprint(open({str(DATA / 'nvidia_smi_4xL40S.csv')!r}).read(), end='')\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    gpus = discover_gpus(None, "n")
    assert [g.gpu_class for g in gpus] == ["L40S-48GB"] * 4


def test_discovery_reports_a_failing_nvidia_smi(monkeypatch, tmp_path):
    script = tmp_path / "nvidia-smi"
    script.write_text(
        f"#!{sys.executable}\nimport sys\n"
        "print('NVIDIA-SMI has failed because it could not communicate with the driver', file=sys.stderr)\n"
        "sys.exit(9)\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(GPUDiscoveryError, match="exit code 9: NVIDIA-SMI has failed"):
        discover_gpus(None, "n")
