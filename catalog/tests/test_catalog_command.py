"""`manage.py catalog export/apply`: thin over catalog.as_code, one line per model, CommandError for bad files."""

import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from catalog.models import Model

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]

CATALOG = """\
models:
- name: qwen-7b
  source: Qwen/Qwen2.5-7B-Instruct
  aliases: [qwen]
  profiles:
  - {engine: mock, gpu_class: L40S-48GB, max_replicas: 2}
  - {engine: mock, gpu_class: H100-80GB}
"""


def run(*args) -> str:
    out = StringIO()
    call_command("catalog", *args, stdout=out, stderr=StringIO(), no_color=True)
    return out.getvalue()


@pytest.fixture
def catalog_file(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text(CATALOG)
    return path


def test_apply_prints_one_line_per_model_and_a_summary(catalog_file):
    Model.objects.create(name="old", source="org/old")
    assert run("apply", str(catalog_file)).splitlines() == [
        "created      qwen-7b: aliases qwen; 2 profiles",
        "not in file  old: kept; --prune deletes",
        "1 created, 0 changed, 0 left alone, 0 deleted, 1 not in file (kept; --prune deletes)",
    ]
    assert run("apply", str(catalog_file), "--prune").splitlines() == [
        "left alone   qwen-7b",
        "deleted      old: 0 profiles, 0 replicas go with it",
        "0 created, 0 changed, 1 left alone, 1 deleted",
    ]


def test_dry_run_says_so_and_changes_nothing(catalog_file):
    out = run("apply", str(catalog_file), "--dry-run")
    assert out.splitlines()[-1] == "dry run, nothing changed: 1 created, 0 changed, 0 left alone, 0 deleted"
    assert not Model.objects.exists()


def test_export_to_stdout_or_a_file_applies_back_as_a_no_op(catalog_file, tmp_path):
    run("apply", str(catalog_file))
    exported = run("export")
    assert exported.startswith("models:\n- name: qwen-7b\n  source: Qwen/Qwen2.5-7B-Instruct\n")
    assert "  aliases: [qwen]\n" in exported
    run("export", str(tmp_path / "out.yaml"))
    assert (tmp_path / "out.yaml").read_text() == exported == run("export", "-")
    assert run("apply", str(tmp_path / "out.yaml")).splitlines()[0] == "left alone   qwen-7b"


def test_a_bad_file_is_a_command_error_listing_every_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(CATALOG.replace("max_replicas: 2", 'max_replicas: "two"').replace("[qwen]", "[qwen-7b]"))
    with pytest.raises(CommandError) as caught:
        run("apply", str(bad))
    assert str(caught.value) == (
        f"{bad}: 2 problems, nothing changed:\n"
        "  models[0] \"qwen-7b\": profiles[0].max_replicas: expected an integer, got a string ('two')\n"
        '  models[0] "qwen-7b": aliases[0]: “qwen-7b” is this model\'s own name; an alias must differ from it'
    )
    assert not Model.objects.exists()


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(CommandError, match=f"cannot read {tmp_path}/nope.yaml: No such file or directory"):
        run("apply", str(tmp_path / "nope.yaml"))
    with pytest.raises(CommandError, match="cannot write /nonexistent-dir/out.yaml: No such file or directory"):
        run("export", "/nonexistent-dir/out.yaml")


def test_a_bad_file_exits_non_zero_from_the_shell(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [qwen]\n")
    # A file of the wrong shape is refused before the database is read (this one has no tables).
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"LLMGW_HOME": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "manage.py", "catalog", "apply", str(bad)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert (
        "models[0]: expected a mapping with name, source, enabled, continue_streams, parameters_billions, dtype, layers, kv_heads, head_dim, price_input_per_million, price_output_per_million, aliases, profiles"
        in done.stderr
    )
