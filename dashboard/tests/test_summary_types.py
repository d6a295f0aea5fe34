"""The typed summary is the one description of its shape: the choices, the JSON form and the schema follow it."""

import dataclasses
import typing

import pytest
from drf_spectacular.generators import SchemaGenerator

from dashboard import summary_types
from dashboard.summary import cluster_summary
from dashboard.summary_types import GPU_STATES, Capacity, ClusterSummary, NodeCounts, ReplicaCounts, ReplicaStatus
from inventory.choices import NodeState
from reconciler.choices import ReplicaState
from reconciler.demand.idle import UNKNOWN, Idle
from tests.fleet import make_model, make_node, make_replica


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_count_fields_follow_the_state_choices():
    assert names(ReplicaCounts) == [*ReplicaState.values, "total"]
    assert set(names(NodeCounts)) == {*NodeState.values, "total", "cordoned"}
    assert names(Capacity) == ["gpu_class", "total", *GPU_STATES]


def test_a_replicas_idle_is_read_back_as_the_one_idle_type():
    row = dict(
        id=1,
        model="m",
        profile_id=1,
        state="ready",
        nodes=[],
        gpus=0,
        endpoint="",
        ready_at=None,
        sleeping_level=None,
        host_memory_bytes=None,
        wake_seconds=None,
        adapters_loaded=0,
        adapters_loading=0,
    )
    assert ReplicaStatus(**row, last_used=None, idle_seconds=-1.0, idle_known=False).idle is UNKNOWN
    assert ReplicaStatus(**row, last_used=None, idle_seconds=42.0, idle_known=True).idle == Idle(42.0)


@pytest.mark.django_db
def test_the_json_form_has_every_field_of_every_value_in_order():
    node = make_node("gpu-a", gpus=2)
    make_replica(make_model("m", gpus_per_node=1).profiles.get(), placement=[(node, [0])])
    summary = cluster_summary()
    data = summary.as_json()
    assert list(data) == names(ClusterSummary)
    assert list(data["replica_list"][0]) == names(ReplicaStatus)
    assert list(data["nodes"]) == names(NodeCounts) and list(data["replicas"]) == names(ReplicaCounts)
    assert dict(summary.replicas.items()) == data["replicas"]


def test_the_status_schema_is_derived_from_the_dataclasses():
    schema = SchemaGenerator().get_schema(request=None, public=True)
    status = schema["paths"]["/api/v1/status/"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    components = schema["components"]["schemas"]
    assert status == {"$ref": "#/components/schemas/ClusterSummary"}
    described = [
        cls
        for cls in vars(summary_types).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__module__ == summary_types.__name__
    ]
    assert len(described) == 25
    for cls in described:
        component = components[cls.__name__]
        assert list(component["properties"]) == names(cls), cls.__name__
        assert set(component["required"]) == set(names(cls)), cls.__name__
        hints = typing.get_type_hints(cls)
        nullable = {name for name, hint in hints.items() if type(None) in typing.get_args(hint)}
        assert {name for name, prop in component["properties"].items() if prop.get("nullable")} == nullable
