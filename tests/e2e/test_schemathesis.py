"""The REST API against its own schema from outside: schemathesis's CLI, every check, against `up --demo`.

The run docs/api.md's REST API section gives by hand: a staff token made with
`manage.py create_api_token` on the demo's database, then `st run` on
/api/v1/schema with the settings of schemathesis.toml (deterministic, 30
examples per operation; only the model writes and the plan may refuse a
schema-valid body, for the catalog rules their 400 documents).
"""

import re
import subprocess
import sys

import pytest

from tests.e2e.demo_stack import ROOT, demo_stack

pytestmark = pytest.mark.e2e


def staff_token(env: dict[str, str]) -> str:
    """The demo admin's REST API token, made on the demo's own database."""
    made = subprocess.run(
        [sys.executable, "manage.py", "create_api_token", "admin"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


# About two minutes on 2 busy cores, the demo's start included (3,000 requests or so).
@pytest.mark.timeout(400)
def test_the_schemathesis_cli_finds_no_failure_against_the_demo(tmp_path):
    with demo_stack(tmp_path) as demo:
        token = staff_token(demo["env"])
        command = [
            *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(ROOT / "schemathesis.toml"), "run"),
            f"http://127.0.0.1:{demo['port']}/api/v1/schema",
            *("--checks", "all", "--header", f"Authorization: Bearer {token}", "--no-color"),
        ]
        # In the test's folder, so nothing the CLI leaves behind lands in the checkout.
        run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=360)
    assert run.returncode == 0, run.stdout + run.stderr
    # Every operation tested, every case generated passed (none errored or was cut short).
    assert re.search(r"Selected: (\d+)/\1\s+Tested: \1\b", run.stdout), run.stdout
    assert re.search(r"\b(\d+) generated, \1 passed", run.stdout), run.stdout
