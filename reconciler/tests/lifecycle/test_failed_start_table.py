"""The endpoint table says why a model's only replica failed (its engine's own last line), so routers
answer at once; a replica pending, starting or ready again withdraws the reason."""

import pytest

from reconciler.choices import ReplicaState
from reconciler.endpoints import build_endpoint_table, failure_reason
from tests.fleet import make_model, make_node, make_replica

pytestmark = pytest.mark.django_db

ENGINE_ERROR = (
    "engine exited with code 2:\nusage: mock_engine [-h] --port PORT\n"
    "mock_engine: error: unrecognized arguments: --no-such-flag"
)


def failed_replica(profile, error=ENGINE_ERROR):
    replica = make_replica(profile, state=ReplicaState.FAILED)
    replica.last_error = error
    replica.save(update_fields=["last_error"])
    return replica


def test_a_model_whose_only_replica_failed_carries_the_engines_last_line():
    profile = make_model("llama").profiles.get()
    failed_replica(profile)
    assert build_endpoint_table().models["llama"].failed == (
        "engine exited with code 2: mock_engine: error: unrecognized arguments: --no-such-flag"
    )


@pytest.mark.parametrize("other", [ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY])
def test_another_wanted_replica_withdraws_the_reason(other):
    profile = make_model("llama", max_replicas=2).profiles.get()
    failed_replica(profile)
    make_replica(profile, state=other, placement=[(make_node("gpu-a"), [0])] if other != ReplicaState.PENDING else ())
    assert build_endpoint_table().models["llama"].failed is None


def test_only_the_failed_model_carries_a_reason_and_its_latest_failure_wins():
    llama, qwen = make_model("llama", max_replicas=2).profiles.get(), make_model("qwen").profiles.get()
    failed_replica(llama, "engine exited with code 1:\nout of memory")
    failed_replica(llama, "engine did not become healthy within 600 s")
    models = build_endpoint_table().models
    assert models["llama"].failed == "engine did not become healthy within 600 s"
    assert models["qwen"].failed is None
    assert qwen is not None


def test_the_table_is_built_in_five_queries(django_assert_num_queries):
    for name in ("a", "b", "c"):
        failed_replica(make_model(name).profiles.get())
    with django_assert_num_queries(5):
        build_endpoint_table()


@pytest.mark.parametrize(
    "error, reason",
    [
        ("", "its replica failed"),
        ("cannot run vllm: No such file or directory", "cannot run vllm: No such file or directory"),
        ("engine exited with code 1:\n\nTraceback\nValueError: bad   \n", "engine exited with code 1: ValueError: bad"),
        ("engine exited with code 1:\n" + "x" * 1000, "engine exited with code 1: " + "x" * 300),
        (
            "engine exited with code 1:\npydantic_core._pydantic_core.ValidationError: 1 validation error for "
            "ModelConfig\n  Value error, User-specified max_model_len (4096) is greater than the derived "
            "max_model_len\n    For further information visit https://errors.pydantic.dev/2.14/v/value_error\n",
            "engine exited with code 1: Value error, User-specified max_model_len (4096) is greater than the derived "
            "max_model_len",
        ),
    ],
)
def test_failure_reason_is_one_bounded_line(error, reason):
    assert failure_reason(error) == reason
