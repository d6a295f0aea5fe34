"""What each class may use of a full model, and each tenant's share of it (router.picking.shares)."""

import pytest

from router.picking.shares import HEADROOM, PEAK_SECONDS, ModelShares

INTERACTIVE, STANDARD, BATCH = 0, 1, 2


def running(shares: ModelShares, tenant: str, count: int, weight: int = 1, waiting: int = 0, priority=STANDARD):
    use = shares.tenant(tenant, priority, weight)
    use.running, use.waiting = count, waiting
    use.saw()
    return use


def test_a_tenant_alone_may_use_the_whole_capacity():
    shares = ModelShares()
    assert shares.limit(running(shares, "a", 0), 8) == 8


def test_a_flood_leaves_free_the_room_a_light_tenants_recent_peak_needed():
    shares = ModelShares()
    flood = running(shares, "flood", 6, waiting=50)
    light = running(shares, "light", 2)
    light.running = 0  # its answers ended; its peak stays for the window
    assert shares.limit(flood, 16) == 16 - (2 + HEADROOM)
    assert shares.limit(light, 16) == 8  # its weighted half: the flood's peak leaves it nothing more


@pytest.mark.parametrize("weights, expected", [((1, 1, 1, 1), [2, 2, 2, 2]), ((3, 1), [6, 2])])
def test_tenants_that_all_saturate_it_split_it_by_weight(weights, expected):
    shares = ModelShares()
    uses = [running(shares, f"t{i}", 8, weight, waiting=100) for i, weight in enumerate(weights)]
    assert [shares.limit(use, 8) for use in uses] == expected


def test_batch_gets_only_the_room_the_other_classes_leave_and_they_share_the_rest_by_order():
    shares = ModelShares()
    chat = running(shares, "chat", 5, priority=INTERACTIVE)
    chat.running = 3  # its peak stays 5
    standard = running(shares, "team", 20, priority=STANDARD, waiting=2)
    jobs = running(shares, "jobs", 2, priority=BATCH, waiting=10_000)
    # Interactive and standard are not held back by batch, however much it wants, nor by each other (the queue
    # hands free room to interactive first).
    assert shares.limit(chat, 32) == shares.limit(standard, 32) == 32
    assert shares.limit(jobs, 32) == 32 - (5 + HEADROOM) - (22 + HEADROOM) == 3
    running(shares, "more", 4, priority=STANDARD)
    assert shares.limit(jobs, 32) < 0  # nothing spare: batch waits


def test_peaks_are_forgotten_after_the_window_and_idle_tenants_with_them():
    shares = ModelShares()
    shares.rotate(0.0)
    flood = running(shares, "flood", 8, waiting=20)
    gone = running(shares, "gone", 4)
    gone.running = 0
    assert shares.limit(flood, 16) == 16 - (4 + HEADROOM)
    shares.rotate(PEAK_SECONDS / 2)  # its peak moves to the previous half-window: still kept
    assert shares.limit(flood, 16) == 16 - (4 + HEADROOM)
    shares.rotate(PEAK_SECONDS)  # and out
    assert shares.limit(flood, 16) == 16
    assert ("gone", STANDARD) not in shares.tenants and ("flood", STANDARD) in shares.tenants
