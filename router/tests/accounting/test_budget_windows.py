"""A router's budget windows turn at the budget's own local midnight, to the tenth of a second, daylight saving
included; a window is computed once and used until it ends; a budget with no window keeps one counter for ever."""

from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

from hub.budgets import Window, counter_name
from router.accounting.budgets import KEEP_AFTER_WINDOW, BudgetRule, BudgetWindows

PARIS = ZoneInfo("Europe/Paris")


def instant(*parts: int, micro: int = 0) -> float:
    return (datetime(*parts, tzinfo=PARIS) + timedelta(microseconds=micro)).timestamp()


def test_the_counter_turns_at_local_midnight_and_on_the_short_day_of_spring():
    now = [instant(2027, 3, 27, 23, 59, 59, micro=900_000)]  # the night the clocks go forward
    windows = BudgetWindows(clock=lambda: now[0])
    daily = BudgetRule(7, 10**12, Window.DAY, "Europe/Paris", "team “ml”")
    saturday = datetime(2027, 3, 27, tzinfo=PARIS)
    [limit] = windows.limits((daily,))
    assert limit.counter == counter_name(7, saturday.astimezone(UTC)) and limit.limit == 10**12
    assert limit.keep == 1 + KEEP_AFTER_WINDOW  # a tenth of a second left, rounded up, and a day
    now[0] = instant(2027, 3, 28, 0, 0, 0)
    [limit] = windows.limits((daily,))
    sunday = datetime(2027, 3, 28, tzinfo=PARIS)
    assert limit.counter == counter_name(7, sunday.astimezone(UTC))
    # Sunday has 23 hours: it ends at Monday's midnight, 22:00 UTC.
    assert windows.reset_at(daily) == datetime(2027, 3, 28, 22, tzinfo=UTC)


def test_a_budget_with_no_window_has_one_counter_kept_for_ever():
    windows = BudgetWindows(clock=lambda: 1_800_000_000.0)
    rule = BudgetRule(3, 5, Window.NONE, "UTC", "key “ci”")
    assert [(limit.counter, limit.keep) for limit in windows.limits((rule,))] == [("3:all", 0)]
    assert windows.reset_at(rule) is None
