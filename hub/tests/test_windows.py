"""Windows of what users felt: quantiles and shares read from bucket counts, summed over routers, checked on the
way in."""

import msgspec
import pytest

from hub.windows import FIRST_TOKEN_BUCKETS, QUEUE_WAIT_BUCKETS, ModelWindow, merged, quantile, share_within

BOUNDS = (1.0, 2.0, 4.0)


def test_a_quantile_is_interpolated_within_its_bucket_like_prometheus():
    assert quantile([0, 10, 0, 0], BOUNDS, 0.9) == pytest.approx(1.9)
    assert quantile([5, 5, 0, 0], BOUNDS, 0.5) == pytest.approx(1.0)
    assert quantile([0, 0, 0, 3], BOUNDS, 0.9) == 4.0  # in +Inf: the last bound, as histogram_quantile
    assert quantile([0, 0, 0, 0], BOUNDS, 0.9) is None


def test_the_share_within_a_limit_counts_whole_buckets_below_and_part_of_its_own():
    assert share_within([2, 4, 4, 0], BOUNDS, 2.0) == pytest.approx(0.6)
    assert share_within([2, 4, 4, 0], BOUNDS, 3.0) == pytest.approx(0.8)  # half of (2, 4]
    assert share_within([2, 4, 0, 4], BOUNDS, 10.0) == pytest.approx(0.6)  # beyond the last bound: not within
    assert share_within([0, 0, 0, 0], BOUNDS, 1.0) is None


def test_windows_of_several_routers_add_up_bucket_by_bucket():
    t, w = len(FIRST_TOKEN_BUCKETS) + 1, len(QUEUE_WAIT_BUCKETS) + 1
    one = ModelWindow(ttft=[1] * t, waiting={"batch": 2}, served={"red": 10}, waits={"batch": [1] * w})
    two = ModelWindow(ttft=[2] * t, waiting={"batch": 1, "interactive": 3}, served={"red": 5, "blue": 1})
    total = merged([one, two, ModelWindow()])
    assert total.ttft == [3] * t and total.itl == []
    assert total.waiting == {"batch": 3, "interactive": 3}
    assert total.served == {"red": 15, "blue": 1}
    assert total.waits == {"batch": [1] * w}
    assert one.ttft == [1] * t  # the routers' own windows are left as they were


def test_a_window_whose_counts_do_not_match_the_buckets_is_refused_naming_the_field():
    expected = len(FIRST_TOKEN_BUCKETS) + 1
    with pytest.raises(msgspec.ValidationError, match=rf"ttft has 2 bucket counts, not {expected}"):
        msgspec.convert({"ttft": [1, 2]}, ModelWindow)
    with pytest.raises(
        msgspec.ValidationError, match=rf"waits\[batch\] has 1 bucket counts, not {len(QUEUE_WAIT_BUCKETS) + 1}"
    ):
        msgspec.convert({"waits": {"batch": [1]}}, ModelWindow)
