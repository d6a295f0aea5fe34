"""The demo fleet's catalog is a file (runner/demo_catalog.yaml) applied through catalog.as_code;
`up --demo --catalog FILE` applies another one instead."""

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from catalog.as_code import Verdict, export_catalog
from catalog.catalog_file import CatalogFileError
from catalog.models import Model
from inventory.models import Node
from runner.demo import create_demo_fleet

pytestmark = pytest.mark.django_db

MY_CATALOG = """\
models:
- name: tiny
  source: org/tiny
  aliases: [t]
  profiles: [{engine: mock, gpu_class: L40S-48GB}]
"""


def shapes():
    return {
        m["name"]: (m["aliases"], [(p["gpu_class"], p["gpus_per_node"], p["min_replicas"]) for p in m["profiles"]])
        for m in export_catalog()["models"]
    }


def test_the_demo_applies_its_bundled_catalog_file():
    fleet = create_demo_fleet()
    assert shapes() == {
        "bge-m3": (["embeddings"], [("L40S-48GB", 1, 1)]),
        "llama-3.1-70b-instruct": ([], [("H100-80GB", 4, 0)]),
        "llama-3.1-8b-instruct": (["llama3"], [("H100-80GB", 1, 0)]),
        "qwen2.5-7b-instruct": (["qwen"], [("L40S-48GB", 1, 0)]),
    }
    assert {p["engine"] for m in export_catalog()["models"] for p in m["profiles"]} == {"mock"}
    assert fleet.catalog.lines()[-1] == "4 created, 0 changed, 0 left alone, 0 deleted"
    assert [n.name for n in fleet.nodes] == ["gpu-a", "gpu-b", "gpu-c"]


def test_running_the_demo_again_leaves_its_catalog_alone():
    create_demo_fleet()
    again = create_demo_fleet()
    assert {m.verdict for m in again.catalog.models} == {Verdict.LEFT_ALONE}


def test_a_catalog_of_ones_own_replaces_the_bundled_one():
    fleet = create_demo_fleet(catalog_text=MY_CATALOG)
    assert shapes() == {"tiny": (["t"], [("L40S-48GB", 1, 0)])}
    assert Node.objects.count() == 3 and fleet.api_key


def test_a_bad_catalog_creates_no_part_of_the_demo():
    with pytest.raises(CatalogFileError, match=r'models\[0\] "tiny": profiles\[0\].gpus_per_node: expected an integer'):
        create_demo_fleet(
            catalog_text=MY_CATALOG.replace("gpu_class: L40S-48GB", "gpu_class: L40S-48GB, gpus_per_node: x")
        )
    assert not Model.objects.exists() and not Node.objects.exists()
    assert not get_user_model().objects.exists()


def test_up_refuses_catalog_without_demo(tmp_path):
    with pytest.raises(CommandError, match="--catalog goes with --demo; .*manage.py catalog apply FILE"):
        call_command("up", "--catalog", str(tmp_path / "c.yaml"))


def test_up_names_an_unreadable_or_bad_catalog_and_starts_nothing(tmp_path):
    with pytest.raises(CommandError, match=f"cannot read {tmp_path}/missing.yaml: No such file or directory"):
        call_command("up", "--demo", "--catalog", str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: []\nnodes: []\n")
    with pytest.raises(CommandError, match=r"bad.yaml: nothing started:\n  unknown top-level key 'nodes'"):
        call_command("up", "--demo", "--catalog", str(bad))
    assert not Node.objects.exists()
