"""`manage.py plan`: one block per model in text, the planner's answer as JSON, a clear error for bad input."""

import json
import re
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from reconciler.models import ModelLoad, Replica
from tests.fleet import make_model, make_node

pytestmark = pytest.mark.django_db

FILE = """
models:
  - name: small
    source: org/small
    parameters_billions: 7.0
    dtype: bfloat16
    profiles:
      - {gpu_class: H100-80GB, gpus_per_node: 2, min_replicas: 0}
  - name: huge
    source: org/huge
    profiles:
      - {gpu_class: H100-80GB, gpus_per_node: 16, min_replicas: 0}
"""


def run(*args):
    out, err = StringIO(), StringIO()
    call_command("plan", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def catalog_file(tmp_path):
    path = tmp_path / "wanted.yaml"
    path.write_text(FILE)
    return path


def test_text_output_has_one_block_per_model(catalog_file):
    make_node("gpu-a", gpus=8)

    out, _ = run("--file", str(catalog_file))

    small, huge, usage = out.strip().split("\n\n")
    assert small.splitlines()[0] == "small: fits on profiles[0] H100-80GB×2"
    assert small.splitlines()[1].startswith("  memory: needs ")
    assert small.splitlines()[2] == "  where: gpu-a GPUs 0,1"
    assert huge.splitlines() == [
        "huge: does not fit",
        "  profiles[0] H100-80GB×16: gpu_count: needs 16 H100-80GB GPUs on one node; the most on one node: 8",
    ]
    assert usage == "nothing counts as idle, so nothing would be stopped: no tick has collected usage yet"


def test_json_output_is_the_planners_answer_for_catalog_models():
    make_node("gpu-a", gpus=8)
    make_model("llama", gpus_per_node=4)

    out, _ = run("llama", "--json")

    answer = json.loads(out)
    (model,) = answer["models"]
    assert (model["name"], model["verdict"], model["profile"], model["stop"]) == ("llama", "fits", 0, [])
    assert model["where"] == [{"node": "gpu-a", "gpus": [0, 1, 2, 3]}]
    assert set(model) >= {"needs_gib_per_gpu", "usable_gib_per_gpu", "full_length_sequences", "reason", "profiles"}
    assert not Replica.objects.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give a catalog file (--file FILE) or catalog model names to plan"),
        (("nope",), "no catalog model or alias named 'nope'"),
        (("--file", "/nonexistent/wanted.yaml"), "cannot read /nonexistent/wanted.yaml: No such file or directory"),
    ],
)
def test_bad_arguments_are_a_clear_command_error(args, message):
    with pytest.raises(CommandError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run(*args)


def test_a_bad_file_names_each_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: x\n    source: org/x\n    profiles: [{gpus_per_node: 0}]\n")
    with pytest.raises(CommandError) as error:
        run("--file", str(bad))
    assert "nothing planned" in str(error.value)
    assert 'models[0] "x": profiles[0].gpu_class: missing (required)' in str(error.value)

    bad.write_text("models: [\n")
    with pytest.raises(CommandError, match="is not valid YAML"):
        run("--file", str(bad))


def test_load_answers_how_many_replicas_a_multiple_of_todays_load_would_need():
    model = make_model("llama", max_replicas=8, target_concurrency=4)
    ModelLoad.objects.create(model=model, in_flight=10)
    assert run("llama", "--load", "2")[0].strip() == (
        "llama: 5 replicas at 2× the load of the routers' last window (0 ready now): "
        "10 requests in flight, a target of 4 per replica"
    )
    printed = json.loads(run("llama", "--load", "2", "--json")[0])["load"][0]
    assert printed["replicas"] == 5 and printed["factor"] == 2


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (["llama", "--load", "0"], "the load factor must be above 0 and at most 1000, got 0"),
        (["llama", "--load", "lots"], "the load factor must be a number (2 for twice today's), got 'lots'"),
        (["--load", "2", "--file", "x.yaml"], "--load plans catalog models by name, not a file: name the models"),
        (["nope", "--load", "2"], "no catalog model or alias named 'nope'"),
    ],
)
def test_a_bad_load_question_is_a_clear_error(args, problem):
    make_model("llama")
    with pytest.raises(CommandError, match=re.escape(problem)):
        run(*args)
