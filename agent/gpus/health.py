"""Live GPU health for the node agent, read again before every heartbeat.

Three readers share one shape, `read() -> {index: GPUCondition}`:

* `NVMLHealth` asks NVML (the `pynvml` module of nvidia-ml-py) through device
  handles opened once: uncorrectable ECC errors (volatile count), hardware
  slowdown (thermal or power brake), critical XID events (drained from an
  event set without waiting), and a GPU that fell off the bus
  (NVML_ERROR_GPU_IS_LOST / NVML_ERROR_RESET_REQUIRED on any call).
* `NvidiaSmiHealth` runs `nvidia-smi --query-gpu` when NVML cannot be loaded;
  it sees the same things but XIDs (nvidia-smi does not report them).
* `SimulatedHealth` for `--fake-gpus`: healthy until a test says otherwise
  (`set`, or `Agent.set_gpu_health`), or a drill writes the file given with
  `--fake-gpu-health` (JSON `{"INDEX": "reason"}`: the GPUs unhealthy now).

A critical XID leaves the GPU unhealthy until the agent restarts: the driver
needs a reset for most of them, and a card that recovers by itself is rare
enough to want a person to look. The other reasons clear when the reading does.
`HealthMonitor` bounds each read in time (a hung nvidia-smi or NVML call must
not hold heartbeats back): a read that overruns is abandoned and the previous
reading is reported again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec

from agent.gpus.discovery import GPUInfo
from nodewire.parts import GPUHealth, GPUReport

log = logging.getLogger(__name__)

NVIDIA_SMI_HEALTH_FIELDS = (
    "index",
    "uuid",
    "ecc.errors.uncorrected.volatile.total",
    "clocks_throttle_reasons.hw_slowdown",
    "clocks_throttle_reasons.hw_thermal_slowdown",
    "clocks_throttle_reasons.hw_power_brake_slowdown",
)
NVIDIA_SMI_HEALTH_QUERY = [f"--query-gpu={','.join(NVIDIA_SMI_HEALTH_FIELDS)}", "--format=csv,noheader,nounits"]
READ_TIMEOUT_SECONDS = 5.0
# XIDs an application causes (bad memory access, a killed context, …): the GPU itself is fine.
# The same list the Kubernetes NVIDIA device plugin skips.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# Markers nvidia-smi prints in place of a value when it cannot talk to the GPU.
LOST_MARKERS = ("Unable to determine the device handle", "GPU requires reset", "Unknown Error", "GPU is lost")
_THROTTLE_REASONS = (
    ("clocks_throttle_reasons.hw_slowdown", "hardware slowdown"),
    ("clocks_throttle_reasons.hw_thermal_slowdown", "thermal slowdown"),
    ("clocks_throttle_reasons.hw_power_brake_slowdown", "power brake slowdown"),
)


@dataclass(frozen=True)
class GPUCondition:
    """One GPU's health now, and why not when unhealthy."""

    healthy: bool
    reason: str = ""


HEALTHY = GPUCondition(True)
Reading = dict[int, GPUCondition]


class HealthReader(Protocol):
    """Something that reads every GPU's health now (blocking; run it in a thread)."""

    def read(self) -> Reading: ...


def _join(reasons: list[str]) -> GPUCondition:
    return GPUCondition(False, "; ".join(reasons)) if reasons else HEALTHY


def parse_health_csv(csv_text: str, indices: list[int]) -> Reading:
    """Health per GPU from nvidia-smi's NVIDIA_SMI_HEALTH_QUERY output; ValueError names a malformed line.

    A known GPU absent from the output, or whose line carries a lost-GPU marker,
    is lost. "[N/A]" / "[Not Supported]" mean the GPU has no such counter (no ECC
    on consumer cards), which is not a fault.
    """
    reading: Reading = {}
    lost_lines = []
    for number, line in enumerate(csv_text.splitlines(), start=1):
        if not line.strip():
            continue
        if any(marker in line for marker in LOST_MARKERS) and not line.split(",")[0].strip().isdigit():
            lost_lines.append(line.strip())  # a message line, not a GPU's row
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != len(NVIDIA_SMI_HEALTH_FIELDS):
            raise ValueError(
                f"nvidia-smi line {number} has {len(fields)} fields, expected {len(NVIDIA_SMI_HEALTH_FIELDS)}: "
                f"{line.strip()!r}"
            )
        try:
            index = int(fields[0])
        except ValueError:
            raise ValueError(f"nvidia-smi line {number}: GPU index {fields[0]!r} is not an integer") from None
        values = dict(zip(NVIDIA_SMI_HEALTH_FIELDS, fields, strict=True))
        lost = [v for v in fields[2:] if any(marker in v for marker in LOST_MARKERS)]
        if lost:
            reading[index] = GPUCondition(False, f"GPU lost: nvidia-smi reports {lost[0]}")
            continue
        reasons = []
        ecc = values["ecc.errors.uncorrected.volatile.total"]
        if ecc.isdigit() and int(ecc) > 0:
            reasons.append(f"{int(ecc)} uncorrectable ECC error(s)")
        elif not ecc.isdigit() and not ecc.startswith("["):
            raise ValueError(f"nvidia-smi line {number}: ECC count {ecc!r} is not a number")
        for field, words in _THROTTLE_REASONS:
            if values[field] == "Active":
                reasons.append(words)
        reading[index] = _join(reasons)
    for index in indices:
        if index not in reading:
            why = f": {lost_lines[0]}" if lost_lines else ""
            reading[index] = GPUCondition(False, f"GPU lost: nvidia-smi no longer reports it{why}")
    return reading


class NvidiaSmiHealth:
    """Health from `nvidia-smi --query-gpu`, for nodes where NVML cannot be loaded."""

    def __init__(self, binary: str, indices: list[int], timeout: float = READ_TIMEOUT_SECONDS):
        self.binary = binary
        self.indices = list(indices)
        self.timeout = timeout

    def read(self) -> Reading:
        try:
            result = subprocess.run(
                [self.binary, *NVIDIA_SMI_HEALTH_QUERY], capture_output=True, text=True, timeout=self.timeout
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"nvidia-smi did not answer within {self.timeout:g} s") from None
        # A lost GPU makes nvidia-smi exit non-zero while still printing the others' rows.
        return parse_health_csv(result.stdout + "\n" + result.stderr, self.indices)


class NVMLHealth:
    """Health from NVML, with device handles and the XID event set opened once.

    `nvml` is the `pynvml` module (or, in tests, a stand-in with the same names
    returning recorded values); `uuids` maps each GPU index to its uuid, to tell
    which GPU an XID event is about.
    """

    def __init__(self, nvml: Any, uuids: dict[int, str]):
        self.nvml = nvml
        self.uuids = dict(uuids)
        self._index_of_uuid = {u: i for i, u in uuids.items()}
        self._xids: dict[int, list[int]] = {}
        nvml.nvmlInit()
        self._handles: dict[int, Any] = {}
        try:
            self._events: Any = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            # XIDs are then not seen; ECC, slowdown and lost GPUs still are.
            log.warning("NVML events unavailable (%s); XID errors will not be reported", exc)
            self._events = None
        for index in uuids:
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as exc:
                log.warning("GPU %s: no NVML handle (%s); it is reported lost", index, exc)
                continue
            self._handles[index] = handle
            if self._events is None:
                continue
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self._events)
            except nvml.NVMLError as exc:
                # Not supported on every GPU (some consumer cards): the other checks still run.
                log.info("GPU %s: XID events unavailable (%s)", index, exc)

    def read(self) -> Reading:
        self._drain_xids()
        return {index: self._condition(index) for index in self.uuids}

    def _condition(self, index: int) -> GPUCondition:
        nvml = self.nvml
        handle = self._handles.get(index)
        if handle is None:
            return GPUCondition(False, "GPU lost: NVML has no handle for it")
        reasons = [f"XID {xid}" for xid in self._xids.get(index, [])]
        try:
            ecc = self._optional(
                lambda: nvml.nvmlDeviceGetTotalEccErrors(
                    handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
                )
            )
            if ecc:
                reasons.append(f"{ecc} uncorrectable ECC error(s)")
            throttle = self._optional(lambda: nvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle)) or 0
            for bit, words in (
                (nvml.nvmlClocksThrottleReasonHwSlowdown, "hardware slowdown"),
                (nvml.nvmlClocksThrottleReasonHwThermalSlowdown, "thermal slowdown"),
                (nvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown, "power brake slowdown"),
            ):
                if throttle & bit:
                    reasons.append(words)
        except nvml.NVMLError as exc:
            if self._is_lost(exc):
                return GPUCondition(False, f"GPU lost: {exc}")
            raise
        return _join(reasons)

    def _optional(self, call: Callable[[], int]) -> int | None:
        """A counter the GPU may not have (NVML_ERROR_NOT_SUPPORTED): None, not a fault."""
        try:
            return call()
        except self.nvml.NVMLError as exc:
            if exc.value == self.nvml.NVML_ERROR_NOT_SUPPORTED:
                return None
            raise

    def _is_lost(self, exc: Any) -> bool:
        nvml = self.nvml
        return exc.value in (nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_RESET_REQUIRED, nvml.NVML_ERROR_UNKNOWN)

    def _drain_xids(self) -> None:
        """Take every pending XID event without waiting (timeout 0 ms)."""
        nvml = self.nvml
        while self._events is not None:
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)
            except nvml.NVMLError as exc:
                if exc.value != nvml.NVML_ERROR_TIMEOUT:
                    log.warning("reading XID events failed: %s", exc)
                return
            xid = int(event.eventData)
            if xid in APPLICATION_XIDS:
                continue
            try:
                index = self._index_of_uuid.get(nvml.nvmlDeviceGetUUID(event.device))
            except nvml.NVMLError:
                index = None
            if index is None:
                log.warning("XID %s on a GPU the agent does not report", xid)
                continue
            log.error("GPU %s: XID %s; it stays unhealthy until the agent restarts", index, xid)
            self._xids.setdefault(index, []).append(xid)


class SimulatedHealth:
    """Health of fake GPUs: as discovered, unless `set` or the watched file says otherwise (tests, drills).

    The file is read again only when its modification time changes; a file
    that cannot be read or parsed changes nothing (a warning says why).
    """

    def __init__(self, initial: Reading, watch: str | None = None):
        self._base = dict(initial)
        self._conditions: Reading = dict(initial)
        self.watch = watch
        self._seen: float | None = None

    def set(self, index: int, healthy: bool, reason: str = "") -> None:
        if index not in self._conditions:
            raise ValueError(f"GPU {index} is not on this node (GPUs: {sorted(self._conditions)})")
        self._conditions[index] = GPUCondition(healthy, "" if healthy else (reason or "marked unhealthy"))

    def read(self) -> Reading:
        if self.watch is not None:
            self._reload(self.watch)
        return dict(self._conditions)

    def _reload(self, path: str) -> None:
        try:
            mtime: float | None = os.stat(path).st_mtime
        except FileNotFoundError:
            mtime = None
        if mtime == self._seen:
            return
        self._seen = mtime
        try:
            sick = parse_fake_health(Path(path).read_text(), set(self._base)) if mtime is not None else {}
        except (OSError, ValueError) as exc:
            log.warning("fake GPU health file %s ignored: %s", path, exc)
            return
        self._conditions = {i: GPUCondition(False, sick[i]) if i in sick else c for i, c in self._base.items()}


def parse_fake_health(text: str, indices: set[int]) -> dict[int, str]:
    """The unhealthy fake GPUs a `--fake-gpu-health` file names: `{"INDEX": "reason"}`; ValueError says why not."""
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError('expected an object such as {"0": "XID 79"}')
    sick = {}
    for key, reason in data.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) in indices):
            raise ValueError(f"{key!r} is not a GPU index of this node ({sorted(indices)})")
        if not isinstance(reason, str):
            raise ValueError(f"the reason for GPU {key} must be a string")
        sick[int(key)] = reason or "marked unhealthy"
    return sick


def gpu_reports(gpus: list[GPUInfo], reading: Reading) -> list[GPUReport]:
    """The GPUs as hello describes them, with their health as last read."""
    return [
        msgspec.structs.replace(gpu.report(), healthy=now.healthy, reason=now.reason)
        for gpu in gpus
        for now in [reading.get(gpu.index, GPUCondition(gpu.healthy))]
    ]


def gpu_health_reports(gpus: list[GPUInfo], reading: Reading) -> list[GPUHealth]:
    """The GPUs' health as a heartbeat reports it."""
    return [
        GPUHealth(index=gpu.index, healthy=now.healthy, reason=now.reason)
        for gpu in gpus
        for now in [reading.get(gpu.index, GPUCondition(gpu.healthy))]
    ]


class HealthMonitor:
    """Runs a reader off the event loop, at most one read at a time, each bounded in time.

    The last good reading (initially: what discovery found) is what a heartbeat
    reports when a read fails or overruns; an overrunning read is left to finish
    in its thread, and no new one starts until it has.
    """

    def __init__(self, reader: HealthReader, initial: Reading, timeout: float = READ_TIMEOUT_SECONDS):
        self.reader = reader
        self.timeout = timeout
        self.last: Reading = dict(initial)
        self._pending: asyncio.Future | None = None

    async def read(self) -> Reading:
        if self._pending is None or self._pending.done():
            self._pending = asyncio.ensure_future(asyncio.to_thread(self.reader.read))
        try:
            reading = await asyncio.wait_for(asyncio.shield(self._pending), self.timeout)
        except TimeoutError:
            log.warning("GPU health read took over %g s; reporting the previous reading", self.timeout)
            return dict(self.last)
        except Exception as exc:  # a reader's failure must not stop heartbeats
            log.warning("GPU health could not be read (%s); reporting the previous reading", exc)
            return dict(self.last)
        self.last.update(reading)
        return dict(self.last)


def hardware_reader(gpus: dict[int, str], nvidia_smi: str | None) -> HealthReader:
    """NVML when nvidia-ml-py and the driver's library load, else nvidia-smi (`gpus`: index → uuid).

    Imported here, not at module level: a node without the NVIDIA driver (or a
    checkout that only simulates GPUs) must still be able to import the agent.
    """
    try:
        import pynvml  # noqa: PLC0415 - optional hardware library, see the docstring

        return NVMLHealth(pynvml, gpus)
    except Exception as exc:  # ImportError, or NVMLError from a missing libnvidia-ml
        if nvidia_smi is None:
            raise RuntimeError(f"neither NVML ({exc}) nor nvidia-smi can read GPU health") from None
        log.info("NVML unavailable (%s); reading GPU health with nvidia-smi", exc)
        return NvidiaSmiHealth(nvidia_smi, list(gpus))
