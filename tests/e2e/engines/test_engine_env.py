"""End to end: a profile's engine env, from a catalog file to the engine process, with no secret in the log.

`up --demo --catalog FILE` applies a catalog whose one model's profile sets an
env (one variable secret); its min replica is placed, the start command goes
through the channel layer to a simulated node's agent, and the agent starts
the mock engine as a real subprocess. The engine's own environment (read from
/proc) holds the variables; the whole process's log shows the start with the
secret masked, and nowhere its value; `catalog export` against the same
database writes the mask.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import wait_until
from tests.e2e.demo_stack import ROOT, demo_stack, engine_pids

pytestmark = pytest.mark.e2e

SECRET = "hf_e2e_secret_value_58213"
CATALOG = f"""
models:
  - name: env-probe
    source: org/env-probe
    profiles:
      - {{engine: mock, gpu_class: L40S-48GB, min_replicas: 1,
         env: {{PROBE_SETTING: "on", HF_TOKEN: "{SECRET}"}}}}
"""


def environment_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
    return dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)


def test_a_profiles_env_reaches_its_engine_and_its_secret_no_log(tmp_path):
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(CATALOG)
    with demo_stack(tmp_path, "--catalog", str(catalog), env={"LOG_LEVEL": "DEBUG"}) as stack:
        pids = wait_until(lambda: engine_pids(stack["var"]), 20, 0.2, describe=lambda: stack["log"].read_text())
        environments = [environment_of(pid) for pid in pids]
        assert [(e["PROBE_SETTING"], e["HF_TOKEN"]) for e in environments] == [("on", SECRET)]
        exported = subprocess.run(
            [sys.executable, "manage.py", "catalog", "export"],
            cwd=ROOT,
            env=stack["env"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        log = stack["log"].read_text()
    assert "env: {HF_TOKEN: '***', PROBE_SETTING: 'on'}" in exported and SECRET not in exported
    assert "HF_TOKEN='***'" in log and "started" in log
    assert SECRET not in log and SECRET[-8:] not in log
