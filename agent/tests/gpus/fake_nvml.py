"""A stand-in for the `pynvml` module that answers from recorded readings (agent/tests/data/nvml_*.json).

Only the names agent/gpus/health.py uses, with pynvml's values for the
constants, so the reader runs unchanged against it. NVML is the hardware
boundary: this machine has no GPU and no libnvidia-ml.
"""

import json
from pathlib import Path

import pynvml

DATA = Path(__file__).parents[1] / "data"


class FakeNVML:
    """pynvml's API over one recorded node; `xid_events` are handed out once, as NVML's event queue does."""

    NVML_VOLATILE_ECC = pynvml.NVML_VOLATILE_ECC
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    NVML_ERROR_NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
    NVML_ERROR_TIMEOUT = pynvml.NVML_ERROR_TIMEOUT
    NVML_ERROR_GPU_IS_LOST = pynvml.NVML_ERROR_GPU_IS_LOST
    NVML_ERROR_RESET_REQUIRED = pynvml.NVML_ERROR_RESET_REQUIRED
    NVML_ERROR_UNKNOWN = pynvml.NVML_ERROR_UNKNOWN
    nvmlEventTypeXidCriticalError = pynvml.nvmlEventTypeXidCriticalError
    nvmlClocksThrottleReasonHwSlowdown = pynvml.nvmlClocksThrottleReasonHwSlowdown
    nvmlClocksThrottleReasonHwThermalSlowdown = pynvml.nvmlClocksThrottleReasonHwThermalSlowdown
    nvmlClocksThrottleReasonHwPowerBrakeSlowdown = pynvml.nvmlClocksThrottleReasonHwPowerBrakeSlowdown

    class NVMLError(Exception):
        def __init__(self, value):
            super().__init__(pynvml.NVMLError._errcode_to_string.get(value, f"NVML error {value}"))
            self.value = value

    class _Event:
        def __init__(self, device, xid):
            self.device, self.eventData = device, xid

    def __init__(self, recording: str):
        data = json.loads((DATA / recording).read_text())
        self.gpus = data["gpus"]
        self.events = [self._Event(e["gpu"], e["xid"]) for e in data.get("xid_events", [])]
        self.registered: list[int] = []
        self.handle_calls = 0

    @property
    def uuids(self) -> dict[int, str]:
        return {i: gpu["uuid"] for i, gpu in enumerate(self.gpus)}

    def nvmlInit(self):
        pass

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlDeviceGetHandleByIndex(self, index):
        self.handle_calls += 1
        return index  # the handle is the index; real handles are opaque pointers

    def nvmlDeviceRegisterEvents(self, handle, event_types, event_set):
        assert event_types == self.nvmlEventTypeXidCriticalError and event_set == "event-set"
        self.registered.append(handle)

    def _gpu(self, handle):
        gpu = self.gpus[handle]
        if "error" in gpu:
            raise self.NVMLError(gpu["error"])
        return gpu

    def nvmlDeviceGetTotalEccErrors(self, handle, error_type, counter_type):
        assert (error_type, counter_type) == (self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self.NVML_VOLATILE_ECC)
        value = self._gpu(handle)["ecc_uncorrected_volatile"]
        if value is None:
            raise self.NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle):
        return self._gpu(handle)["clocks_throttle_reasons"]

    def nvmlDeviceGetUUID(self, device):
        return self.gpus[device]["uuid"]

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        assert timeout_ms == 0, "the reader must never wait for events"
        if not self.events:
            raise self.NVMLError(self.NVML_ERROR_TIMEOUT)
        return self.events.pop(0)
