"""The migration that keeps agents' reports apart: on nodes an agent has greeted from, the stored address,
fabric and labels were its report (every hello overwrote them), so they move to reported_*; nodes never
seen keep their enrolment values as the operator's."""

import pytest

from conftest import migrate_to

BEFORE = [("inventory", "0003_gpu_health_reason_and_weights")]
AFTER = [("inventory", "0004_node_reported_address_fabric_labels")]


@pytest.mark.django_db(transaction=True)
def test_reports_move_to_reported_fields_and_enrolment_values_stay():
    old = migrate_to(BEFORE).get_model("inventory", "Node")
    old.objects.create(name="seen", address="10.0.0.5", fabric="ib-a", labels={"rack": "r1"}, agent_version="0.1.0")
    old.objects.create(name="never-seen", address="10.0.0.6", fabric="ib-b")

    new = migrate_to(AFTER).get_model("inventory", "Node")
    seen, never = new.objects.get(name="seen"), new.objects.get(name="never-seen")
    assert (seen.address, seen.fabric, seen.labels) == ("", "", {})
    assert (seen.reported_address, seen.reported_fabric, seen.reported_labels) == ("10.0.0.5", "ib-a", {"rack": "r1"})
    assert (never.address, never.fabric, never.reported_address) == ("10.0.0.6", "ib-b", "")

    # Back to the latest state for the tests that follow.
    migrate_to()
