"""The router's request metrics: plain numbers on the hot path, rendered as Prometheus families when scraped."""

from bisect import bisect_left

from prometheus_client.parser import text_string_to_metric_families

from router.metrics import UPSTREAM_LATENCY_BUCKETS, RouterMetrics


def samples(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_answers_are_counted_per_model_and_status():
    metrics = RouterMetrics()
    for model, status in [("a", 200), ("a", 200), ("a", 429), ("-", 404)]:
        metrics.traffic.answered(model, status)
    got = samples(metrics)
    assert got[("llmgw_router_requests_total", (("code", "200"), ("model", "a")))] == 2
    assert got[("llmgw_router_requests_total", (("code", "429"), ("model", "a")))] == 1
    assert got[("llmgw_router_requests_total", (("code", "404"), ("model", "-")))] == 1


def test_upstream_latency_buckets_are_cumulative_and_a_bound_holds_its_own_value():
    metrics = RouterMetrics()
    for seconds in (0.001, 0.005, 0.2, 7.0, 1000.0):
        metrics.traffic.upstream_latency("a", seconds)
    got = samples(metrics)

    def bucket(le: str) -> float:
        return got[("llmgw_router_upstream_latency_seconds_bucket", (("le", le), ("model", "a")))]

    assert bucket("0.005") == 2  # 0.005 itself is `le` 0.005
    assert bucket("0.01") == 2
    assert bucket("0.25") == 3
    assert bucket("10.0") == 4
    assert bucket("300.0") == 4
    assert bucket("+Inf") == 5
    assert got[("llmgw_router_upstream_latency_seconds_count", (("model", "a"),))] == 5
    assert abs(got[("llmgw_router_upstream_latency_seconds_sum", (("model", "a"),))] - 1007.206) < 1e-9
    assert len([k for k in got if k[0].endswith("_bucket")]) == len(UPSTREAM_LATENCY_BUCKETS) + 1


def test_requests_in_flight_are_reported_as_a_gauge():
    metrics = RouterMetrics()
    metrics.traffic.in_flight += 3
    metrics.traffic.in_flight -= 1
    assert samples(metrics)[("llmgw_router_in_flight_requests", ())] == 2


def test_a_holds_time_is_kept_per_model_and_reason():
    metrics = RouterMetrics()
    metrics.traffic.held("a", "wake", 1.5)
    metrics.traffic.held("a", "cold_start", 45.0)
    metrics.traffic.held("a", "wake", 0.7)
    got = samples(metrics)

    def count(reason: str) -> float:
        return got[("llmgw_router_hold_seconds_count", (("model", "a"), ("reason", reason)))]

    assert (count("wake"), count("cold_start")) == (2, 1)
    assert got[("llmgw_router_hold_seconds_bucket", (("le", "1.0"), ("model", "a"), ("reason", "wake")))] == 1
    assert got[("llmgw_router_hold_seconds_bucket", (("le", "60.0"), ("model", "a"), ("reason", "cold_start")))] == 1
    assert got[("llmgw_router_hold_seconds_sum", (("model", "a"), ("reason", "wake")))] == 2.2


def test_values_a_loop_counts_into_a_series_itself_are_rendered_like_observed_ones():
    metrics = RouterMetrics()
    inter_token = metrics.traffic.inter_token
    series = inter_token.series("a")
    for gap in (0.01, 0.02, 0.02, 3.0):  # as the relay loop counts a stream's gaps
        series[0][bisect_left(inter_token.bounds, gap)] += 1
        series[1] += gap
    inter_token.observe("a", 0.1)
    unkept = inter_token.blank()  # a body that is not a stream counts into this
    unkept[0][0] += 1
    got = samples(metrics)

    def bucket(le: str) -> float:
        return got[("llmgw_router_inter_token_seconds_bucket", (("le", le), ("model", "a")))]

    assert inter_token.series("a") is series
    assert (bucket("0.01"), bucket("0.02"), bucket("0.1"), bucket("2.5"), bucket("+Inf")) == (1, 3, 4, 4, 5)
    assert got[("llmgw_router_inter_token_seconds_count", (("model", "a"),))] == 5
    assert abs(got[("llmgw_router_inter_token_seconds_sum", (("model", "a"),))] - 3.15) < 1e-9
