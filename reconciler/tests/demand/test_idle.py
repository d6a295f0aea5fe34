"""Idle: unknown last use is a value of its own, never zero idle (DESIGN invariant 3)."""

from datetime import UTC, datetime, timedelta

from reconciler.demand.idle import UNKNOWN, Idle

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def test_idle_text_is_human_and_dash_when_unknown():
    assert [str(Idle.from_json(s)) for s in (None, -1.0, 0, 42.9, 192, 7500, 90000)] == [
        "-",
        "-",
        "0s",
        "42s",
        "3m12s",
        "2h05m",
        "1d01h",
    ]


def test_unknown_last_use_is_unknown_idle_not_zero():
    idle = Idle.since(None, NOW)
    assert idle is UNKNOWN and not idle.known
    assert idle.as_json() == {"idle_seconds": -1.0, "idle_known": False}
    assert str(idle) == "-"


def test_known_last_use_gives_seconds_and_survives_json():
    idle = Idle.since(NOW - timedelta(seconds=192.5), NOW)
    assert idle.known and idle.seconds == 192.5
    assert idle.as_json() == {"idle_seconds": 192.5, "idle_known": True}
    assert Idle.from_json(**{"seconds": 192.5, "known": True}) == idle
    assert Idle.from_json(192.5, known=False) is UNKNOWN


def test_a_last_use_in_the_future_is_zero_idle_not_negative():
    # Clocks of routers and control plane differ slightly; negative would read as "unknown".
    assert Idle.since(NOW + timedelta(seconds=3), NOW).json_seconds() == 0.0
