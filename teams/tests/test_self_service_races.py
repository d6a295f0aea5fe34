"""The self-service pages' writes at the same moment, on PostgreSQL with real threads: two admins removing each other
leave the team one admin; the same person added twice at once is one membership."""

import threading

import pytest
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import connections

from teams import selfservice
from teams.models import Membership, Team

pytestmark = [pytest.mark.postgres_only, pytest.mark.django_db(transaction=True)]


def at_once(*calls) -> list[str]:
    """Run each call in its own thread (and database connection), released together; what each ended with."""
    barrier, outcomes = threading.Barrier(len(calls)), []

    def run(call):
        try:
            barrier.wait(5)
            call()
            outcomes.append("done")
        except ValidationError as exc:
            outcomes.append(next(iter(exc.message_dict)))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return sorted(outcomes)


@pytest.mark.parametrize("round_", range(5))
def test_two_admins_removing_each_other_at_once_leave_the_team_one(round_):
    team = Team.objects.create(name=f"ml-{round_}")
    ada, cyd = (User.objects.create_user(f"{name}-{round_}") for name in ("ada", "cyd"))
    adas = Membership.objects.create(team=team, user=ada, role=Membership.Role.ADMIN)
    cyds = Membership.objects.create(team=team, user=cyd, role=Membership.Role.ADMIN)

    outcomes = at_once(lambda: selfservice.remove_member(adas), lambda: selfservice.remove_member(cyds))

    assert outcomes == ["done", "user"]
    assert Membership.objects.filter(team=team, role=Membership.Role.ADMIN).count() == 1


def test_the_same_person_added_at_once_is_one_membership():
    team, eve = Team.objects.create(name="ml"), User.objects.create_user("eve")

    outcomes = at_once(*[lambda: selfservice.add_member(team, eve, Membership.Role.MEMBER)] * 4)

    assert outcomes == ["done", "user", "user", "user"]
    assert Membership.objects.filter(team=team, user=eve).count() == 1
