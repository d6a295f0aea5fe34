"""Live GPU health: recorded nvidia-smi output and NVML readings, simulated GPUs, and reads bounded in time."""

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from agent.gpus.health import (
    HEALTHY,
    NVIDIA_SMI_HEALTH_QUERY,
    GPUCondition,
    HealthMonitor,
    NvidiaSmiHealth,
    NVMLHealth,
    SimulatedHealth,
    hardware_reader,
    parse_fake_health,
    parse_health_csv,
)
from agent.tests.gpus.fake_nvml import FakeNVML

DATA = Path(__file__).parents[1] / "data"


def test_the_query_asks_nvidia_smi_for_the_documented_fields():
    assert NVIDIA_SMI_HEALTH_QUERY == [
        "--query-gpu=index,uuid,ecc.errors.uncorrected.volatile.total,clocks_throttle_reasons.hw_slowdown,"
        "clocks_throttle_reasons.hw_thermal_slowdown,clocks_throttle_reasons.hw_power_brake_slowdown",
        "--format=csv,noheader,nounits",
    ]


def test_a_healthy_node_reads_healthy_everywhere():
    reading = parse_health_csv((DATA / "nvidia_smi_health_8xH100_ok.csv").read_text(), list(range(8)))
    assert reading == {i: HEALTHY for i in range(8)}


def test_recorded_faults_are_reported_with_their_reasons():
    reading = parse_health_csv((DATA / "nvidia_smi_health_faults.csv").read_text(), list(range(6)))
    assert reading[0] == HEALTHY
    assert reading[1] == GPUCondition(False, "3 uncorrectable ECC error(s)")
    assert reading[2] == GPUCondition(False, "hardware slowdown; thermal slowdown")
    assert reading[3] == GPUCondition(False, "GPU lost: nvidia-smi reports [GPU requires reset]")
    # No ECC on the card ([N/A]) and an unsupported counter are not faults.
    assert reading[4] == HEALTHY
    # GPU 5 fell off the bus: nvidia-smi prints a message instead of its row.
    assert reading[5].healthy is False
    assert reading[5].reason == (
        "GPU lost: nvidia-smi no longer reports it: "
        "Unable to determine the device handle for GPU 0000:9A:00.0: Unknown Error"
    )


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("0, GPU-a, 0, Not Active", "has 4 fields, expected 6"),
        ("x, GPU-a, 0, Not Active, Not Active, Not Active", "GPU index 'x' is not an integer"),
        ("0, GPU-a, lots, Not Active, Not Active, Not Active", "ECC count 'lots' is not a number"),
    ],
)
def test_malformed_nvidia_smi_output_is_refused_naming_the_line(line, problem):
    with pytest.raises(ValueError, match=problem):
        parse_health_csv(line, [0])


def test_nvidia_smi_reader_runs_the_binary_and_reads_its_output(tmp_path):
    # A recorded nvidia-smi: prints the faults file and exits 255, as the real one does with a GPU lost.
    script = tmp_path / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncat {DATA / 'nvidia_smi_health_faults.csv'}\nexit 255\n")
    script.chmod(0o755)
    reading = NvidiaSmiHealth(str(script), list(range(6))).read()
    assert reading[1].reason == "3 uncorrectable ECC error(s)" and reading[5].healthy is False


def test_a_hung_nvidia_smi_is_cut_off(tmp_path):
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\nsleep 30\n")
    script.chmod(0o755)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="nvidia-smi did not answer within 0.3 s"):
        NvidiaSmiHealth(str(script), [0], timeout=0.3).read()
    assert time.monotonic() - started < 5


def test_nvml_readings_name_xid_ecc_slowdown_and_a_lost_gpu():
    nvml = FakeNVML("nvml_readings_4xH100.json")
    reader = NVMLHealth(nvml, nvml.uuids)
    assert nvml.registered == [0, 1, 2, 3]  # every GPU's XIDs are watched
    reading = reader.read()
    # XID 13 is an application's fault; 79 (fell off the bus) is the GPU's.
    # The GPU-idle throttle bit (0x1) is not a fault either.
    assert reading[0] == GPUCondition(False, "XID 79")
    assert reading[1] == GPUCondition(False, "2 uncorrectable ECC error(s)")
    assert reading[2] == GPUCondition(False, "hardware slowdown; thermal slowdown")
    assert reading[3] == GPUCondition(False, "GPU lost: GPU is lost")


def test_an_xid_keeps_its_gpu_unhealthy_and_handles_are_opened_once():
    nvml = FakeNVML("nvml_readings_4xH100.json")
    reader = NVMLHealth(nvml, nvml.uuids)
    reader.read()
    nvml.gpus[1]["ecc_uncorrected_volatile"] = 0  # the driver reloaded: the volatile count is back to 0
    second = reader.read()
    assert second[0] == GPUCondition(False, "XID 79")  # no new event, still unhealthy
    assert second[1] == HEALTHY
    assert nvml.handle_calls == 4


def test_a_counter_the_gpu_lacks_is_not_a_fault():
    nvml = FakeNVML("nvml_readings_4xH100.json")
    nvml.gpus[1]["ecc_uncorrected_volatile"] = None  # NVML_ERROR_NOT_SUPPORTED, as on cards without ECC
    nvml.events = []
    assert NVMLHealth(nvml, {1: nvml.gpus[1]["uuid"]}).read() == {1: HEALTHY}


def test_without_nvml_the_reader_falls_back_to_nvidia_smi_or_says_neither_works(monkeypatch):
    # On this machine pynvml imports but libnvidia-ml does not load.
    assert isinstance(hardware_reader({0: "GPU-a"}, "/usr/bin/nvidia-smi"), NvidiaSmiHealth)
    with pytest.raises(RuntimeError, match="neither NVML .* nor nvidia-smi can read GPU health"):
        hardware_reader({0: "GPU-a"}, None)


def test_simulated_gpus_change_health_when_told():
    health = SimulatedHealth({0: HEALTHY, 1: HEALTHY})
    health.set(1, False, "XID 79 (simulated)")
    assert health.read() == {0: HEALTHY, 1: GPUCondition(False, "XID 79 (simulated)")}
    with pytest.raises(ValueError, match=r"GPU 7 is not on this node \(GPUs: \[0, 1\]\)"):
        health.set(7, False)


class HungReader:
    """A reader whose first read blocks until released, as a wedged driver call does."""

    def __init__(self):
        self.release = threading.Event()
        self.reads = 0

    def read(self):
        self.reads += 1
        self.release.wait(10)
        return {0: GPUCondition(False, "XID 79")}


def test_a_hung_read_does_not_hold_heartbeats_and_no_second_read_piles_up():
    reader = HungReader()
    monitor = HealthMonitor(reader, {0: HEALTHY}, timeout=0.2)

    async def scenario():
        started = time.monotonic()
        first = await monitor.read()
        second = await monitor.read()
        elapsed = time.monotonic() - started
        reads_while_hung = reader.reads
        reader.release.set()
        await asyncio.sleep(0.05)
        third = await monitor.read()
        return first, second, elapsed, third, reads_while_hung

    first, second, elapsed, third, reads_while_hung = asyncio.run(scenario())
    assert first == second == {0: HEALTHY}  # the previous reading, while the read hangs
    assert elapsed < 1.0
    assert third == {0: GPUCondition(False, "XID 79")}  # read again once the hung read came back
    assert reads_while_hung == 1


def test_a_failing_reader_reports_the_previous_reading():
    class Broken:
        def read(self):
            raise RuntimeError("NVML: driver/library version mismatch")

    monitor = HealthMonitor(Broken(), {0: GPUCondition(False, "XID 48")})
    assert asyncio.run(monitor.read()) == {0: GPUCondition(False, "XID 48")}


def test_a_drill_makes_fake_gpus_unhealthy_by_writing_the_watched_file(tmp_path):
    path = tmp_path / "health.json"
    health = SimulatedHealth({0: HEALTHY, 1: HEALTHY}, watch=str(path))
    assert health.read() == {0: HEALTHY, 1: HEALTHY}  # no file yet: as discovered
    path.write_text('{"1": "XID 79 (drill)"}')
    assert health.read() == {0: HEALTHY, 1: GPUCondition(False, "XID 79 (drill)")}
    path.write_text("{not json")
    os.utime(path, (1, 1))  # a new modification time, whatever the clock's resolution
    assert health.read()[1] == GPUCondition(False, "XID 79 (drill)")  # a broken file changes nothing
    path.unlink()
    assert health.read() == {0: HEALTHY, 1: HEALTHY}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[1]", "expected an object"),
        ('{"7": "x"}', r"'7' is not a GPU index of this node \(\[0, 1\]\)"),
        ('{"0": 3}', "the reason for GPU 0 must be a string"),
        ("{oops", "not JSON"),
    ],
)
def test_a_bad_fake_health_file_is_refused_naming_the_problem(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_fake_health(text, {0, 1})


def test_without_nvml_events_the_other_checks_still_run():
    nvml = FakeNVML("nvml_readings_4xH100.json")

    def no_events():
        raise nvml.NVMLError(nvml.NVML_ERROR_NOT_SUPPORTED)

    nvml.nvmlEventSetCreate = no_events
    reading = NVMLHealth(nvml, nvml.uuids).read()
    assert nvml.registered == []
    assert reading[0] == HEALTHY  # its XID 79 cannot be seen
    assert reading[1] == GPUCondition(False, "2 uncorrectable ECC error(s)")
