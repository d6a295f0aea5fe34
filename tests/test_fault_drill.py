"""A short subset of the fault drill, run by `make test`: the distributed stack on private PostgreSQL
and Redis, load through both routers, then an agent killed, a control plane stopped and a port taken.

The whole drill is `make faults`; its table is in docs/benchmarks.md.
"""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent


def test_the_short_fault_drill_passes():
    result = subprocess.run(
        [sys.executable, "bench/fault_drill.py", "--faults", "agent-kill,control-plane-term,port-busy"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    table = [line for line in result.stdout.splitlines() if line.startswith("| ") and "verdict" not in line]
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert len(table) >= 3 and all(line.rstrip().endswith("| pass |") for line in table[-3:]), result.stdout
