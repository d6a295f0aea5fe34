"""GPU discovery for the node agent: nvidia-smi on real nodes, `--fake-gpus` for simulation.

A GPU class names the product and its marketed memory ("H100-80GB"), so the
placer can match profiles against nodes without knowing product details.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass

from nodewire.parts import GPUReport

NVIDIA_SMI_QUERY = ["--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]

# Sizes GPUs are sold with, in GB. nvidia-smi reports a little less than the
# marketed size (ECC and reserved memory), so a reading is rounded up to the
# nearest of these; past the list, to the next whole GB.
MARKETED_GB = (4, 6, 8, 10, 11, 12, 16, 20, 24, 32, 40, 48, 64, 80, 94, 96, 141, 144, 180, 192, 288)
# Product names carry these words but they do not tell one GPU class from another.
VENDOR_WORDS = {"NVIDIA", "TESLA", "GEFORCE", "QUADRO"}

_FAKE_GROUP = re.compile(r"^(\d+)x([A-Za-z0-9][A-Za-z0-9._]*(?:-[A-Za-z0-9._]+)*-(\d+)GB)$")
_MEMORY_IN_NAME = re.compile(r"(?:^|[\s-])(\d+)GB(?:$|[\s-])", re.IGNORECASE)
# A stable namespace, so fake GPU uuids depend only on node name, index and class.
_FAKE_UUID_NAMESPACE = uuid.UUID("6b1f1c8e-3c52-4d8e-9a57-6c6c6d677721")
MAX_GPUS_PER_NODE = 64


class GPUDiscoveryError(RuntimeError):
    """GPUs could not be discovered on this node; the text says why."""


@dataclass(frozen=True)
class GPUInfo:
    """One GPU as the agent reports it in `hello` (see nodewire/protocol.py)."""

    index: int
    uuid: str
    gpu_class: str
    memory_mb: int
    healthy: bool = True
    # From --fake-gpus: no GPU is there, so engines run on the CPU (agent/engines/launch.py: no GPU-only flags).
    simulated: bool = False

    def report(self) -> GPUReport:
        """This GPU as `hello` carries it."""
        return GPUReport(
            index=self.index, uuid=self.uuid, gpu_class=self.gpu_class, memory_mb=self.memory_mb, healthy=self.healthy
        )


def parse_fake_gpus(spec: str, node_name: str = "") -> list[GPUInfo]:
    """GPUs described by a spec such as `8xH100-80GB` or `4xL40S-48GB,2xA100-40GB`.

    Indices run across the groups in order. Uuids are derived from the node
    name, so a restarted agent reports the same GPUs.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("fake GPU spec is empty; expected e.g. 8xH100-80GB")
    gpus: list[GPUInfo] = []
    for group in spec.split(","):
        group = group.strip()
        match = _FAKE_GROUP.match(group)
        if match is None:
            raise ValueError(f"fake GPU group {group!r} is not COUNTxCLASS-MEMGB (e.g. 8xH100-80GB or 2xL40S-48GB)")
        count, gpu_class, memory_gb = int(match[1]), match[2], int(match[3])
        if count < 1:
            raise ValueError(f"fake GPU group {group!r} has a count of 0; use at least 1")
        if memory_gb < 1:
            raise ValueError(f"fake GPU group {group!r} has 0GB of memory")
        for _ in range(count):
            index = len(gpus)
            if index >= MAX_GPUS_PER_NODE:
                raise ValueError(f"fake GPU spec {spec!r} has more than {MAX_GPUS_PER_NODE} GPUs")
            ident = uuid.uuid5(_FAKE_UUID_NAMESPACE, f"{node_name}/{index}/{gpu_class}")
            gpus.append(GPUInfo(index, f"GPU-{ident}", gpu_class, memory_gb * 1024, True, simulated=True))
    return gpus


def marketed_gb(memory_mb: int) -> int:
    """The marketed memory size (GB) for a memory.total reading in MiB."""
    gib = memory_mb / 1024
    for size in MARKETED_GB:
        # Half a GB of slack: a reading just over a size (e.g. 40960 MiB) is that size.
        if size >= gib - 0.5:
            return size
    return int(-(-gib // 1))


def gpu_class_for(product_name: str, memory_mb: int) -> str:
    """The GPU class for an nvidia-smi product name and memory reading, e.g. "H100-80GB".

    The family is the first word of the product name after vendor words, cut
    at its first hyphen ("A100-SXM4-40GB" → "A100"); "RTX" joins the word after
    it ("RTX A6000" → "RTXA6000"). A size written in the name wins over the
    reading, because the reading varies with ECC and driver reservations.
    """
    family = _family(product_name)
    named = _MEMORY_IN_NAME.search(product_name)
    size = int(named[1]) if named else marketed_gb(memory_mb)
    return f"{family}-{size}GB"


def _family(product_name: str) -> str:
    words = [w for w in product_name.split() if w.upper() not in VENDOR_WORDS]
    if not words:
        raise ValueError(f"GPU product name {product_name!r} names no product")
    family = words[0].split("-")[0]
    if family.upper() == "RTX" and len(words) > 1:
        family = "RTX" + words[1].split("-")[0]
    if not family or not re.fullmatch(r"[A-Za-z0-9._]+", family):
        raise ValueError(f"GPU product name {product_name!r} does not start with a product family")
    return family


def parse_nvidia_smi(csv_text: str) -> list[GPUInfo]:
    """GPUs from `nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits`.

    A GPU whose memory nvidia-smi cannot read (it prints "[N/A]" or an error in
    brackets) is reported unhealthy rather than dropped, so the control plane
    sees it and keeps work off it.
    """
    gpus: list[GPUInfo] = []
    for number, line in enumerate(csv_text.splitlines(), start=1):
        if not line.strip():
            continue
        fields = [f.strip() for f in line.split(",")]
        if len(fields) < 4:
            raise ValueError(f"nvidia-smi line {number} has {len(fields)} fields, expected 4: {line.strip()!r}")
        # Product names do not contain commas today; join the middle in case one does.
        index_text, gpu_uuid, name, memory_text = fields[0], fields[1], ", ".join(fields[2:-1]), fields[-1]
        try:
            index = int(index_text)
        except ValueError:
            raise ValueError(f"nvidia-smi line {number}: GPU index {index_text!r} is not an integer") from None
        if index < 0:
            raise ValueError(f"nvidia-smi line {number}: GPU index {index} is negative")
        if any(g.index == index for g in gpus):
            raise ValueError(f"nvidia-smi line {number}: GPU index {index} appears twice")
        if not gpu_uuid.startswith("GPU-"):
            raise ValueError(f"nvidia-smi line {number}: {gpu_uuid!r} is not a GPU uuid (GPU-…)")
        healthy = True
        try:
            memory_mb = int(memory_text)
        except ValueError:
            if not memory_text.startswith("["):
                raise ValueError(f"nvidia-smi line {number}: memory {memory_text!r} is not a number of MiB") from None
            memory_mb, healthy = 0, False
        if memory_mb < 0:
            raise ValueError(f"nvidia-smi line {number}: memory {memory_mb} MiB is negative")
        try:
            if memory_mb or _MEMORY_IN_NAME.search(name):
                gpu_class = gpu_class_for(name, memory_mb)
            else:
                # Unreadable memory and no size in the name: the size cannot be known.
                gpu_class, healthy = f"{_family(name)}-unknown", False
        except ValueError as exc:
            raise ValueError(f"nvidia-smi line {number}: {exc}") from None
        gpus.append(GPUInfo(index, gpu_uuid, gpu_class, memory_mb, healthy))
    return sorted(gpus, key=lambda g: g.index)


def discover_gpus(fake: str | None, node_name: str) -> list[GPUInfo]:
    """This node's GPUs: from the fake spec when given, else from nvidia-smi."""
    if fake:
        return parse_fake_gpus(fake, node_name)
    binary = shutil.which("nvidia-smi")
    if binary is None:
        raise GPUDiscoveryError(
            "nvidia-smi was not found on PATH; install the NVIDIA driver, or pass --fake-gpus to simulate GPUs"
        )
    try:
        result = subprocess.run([binary, *NVIDIA_SMI_QUERY], capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        raise GPUDiscoveryError("nvidia-smi did not answer within 60 seconds") from None
    except OSError as exc:
        raise GPUDiscoveryError(f"nvidia-smi could not be run: {exc}") from None
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip().splitlines()
        raise GPUDiscoveryError(
            f"nvidia-smi failed with exit code {result.returncode}: {detail[-1] if detail else 'no output'}"
        )
    try:
        return parse_nvidia_smi(result.stdout)
    except ValueError as exc:
        raise GPUDiscoveryError(f"nvidia-smi output could not be read: {exc}") from None


def host_memory_mib(meminfo: str = "/proc/meminfo") -> int | None:
    """The node's host memory in MiB (`MemTotal`), where level-1 sleepers keep their weights; None if unreadable."""
    try:
        with open(meminfo) as lines:
            for line in lines:
                name, _, value = line.partition(":")
                if name == "MemTotal":
                    amount, _, unit = value.strip().partition(" ")
                    if unit.strip().lower() == "kb" and amount.isdigit():
                        return int(amount) // 1024
                    return None
    except OSError:
        return None
    return None
