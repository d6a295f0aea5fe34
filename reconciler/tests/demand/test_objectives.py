"""Scaling on what users feel: latency objectives against the routers' windows, with hysteresis, starting replicas
discounted, and what the tick records for the operators' view."""

from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.utils import timezone

from hub import get_hub
from hub.contracts import UsageReport
from hub.windows import FIRST_TOKEN_BUCKETS, INTER_TOKEN_BUCKETS, QUEUE_WAIT_BUCKETS, ModelWindow
from reconciler.choices import ReplicaState
from reconciler.demand.objectives import MIN_OBSERVATIONS, look_ahead, seen_in_window, step
from reconciler.demand.scaling import apply_demand
from reconciler.demand.spares import PARKED_PRIORITY
from reconciler.endpoints import build_endpoint_table
from reconciler.models import ModelLoad, Replica
from tests.fleet import make_model, make_node, make_replica

UP, DOWN = 0.9, 0.6


def ttft_window(seconds: float, count: int = 100, **more) -> ModelWindow:
    """`count` first tokens, all in the bucket whose upper bound is `seconds`."""
    counts = [0] * (len(FIRST_TOKEN_BUCKETS) + 1)
    counts[FIRST_TOKEN_BUCKETS.index(seconds)] = count
    return ModelWindow(ttft=counts, **more)


# -- the rule, as a pure function ----------------------------------------------------------------


def test_a_ratio_reaching_the_up_threshold_is_over_and_asks_for_the_replicas_that_bring_it_down():
    decided = step(1.8, 2, ready=2, starting=0, was_over=False, up=UP, down=DOWN)
    assert decided.over and decided.pressure == pytest.approx(1.8)
    assert decided.add == 2  # ceil(2 × 1.8 / 0.9) = 4 replicas: 2 more


def test_one_step_at_most_doubles_the_ready_replicas():
    assert step(10.0, 2, ready=2, starting=0, was_over=False, up=UP, down=DOWN).add == 2
    assert step(0.95, 1, ready=1, starting=0, was_over=False, up=UP, down=DOWN).add == 1  # at least one


def test_replicas_still_starting_are_discounted_from_the_pressure():
    decided = step(1.2, 2, ready=2, starting=1, was_over=False, up=UP, down=DOWN)
    assert decided.pressure == pytest.approx(0.8)  # 1.2 × 2 / 3: the one starting will take its share
    assert not decided.over and decided.add == 0


def test_replicas_ready_for_part_of_the_window_count_for_that_part():
    now = timezone.now()
    since = [now - timedelta(hours=1), now - timedelta(seconds=15), now, None]
    assert seen_in_window(since, now, window_seconds=60) == pytest.approx(2.25)
    # Two ready replicas, one of them for a quarter of the window: the p90 saw 1.25 of them.
    decided = step(1.8, 1.25, ready=2, starting=0, was_over=False, up=UP, down=DOWN)
    assert decided.pressure == pytest.approx(1.8 * 1.25 / 2)
    assert decided.add == 1  # ceil(1.25 × 1.8 / 0.9) = 3: one more, not two


def test_a_model_whose_new_replicas_the_window_has_not_seen_serve_waits_for_them(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 0
    settings.LLMGW_LATENCY_WINDOW_SECONDS = 60
    model = model_with_objectives(ttft=1.0, ready=2)
    Replica.objects.filter(model=model).update(ready_at=timezone.now())  # both just became ready
    assert apply_demand(set(), timezone.now(), in_flight={}, windows={"llama": ttft_window(5)}).scaled_out == 0


def test_between_the_thresholds_a_model_over_stays_over_without_adding_and_one_below_stays_below():
    held = step(0.7, 2, ready=2, starting=0, was_over=True, up=UP, down=DOWN)
    assert held.over and held.add == 0
    assert not step(0.7, 2, ready=2, starting=0, was_over=False, up=UP, down=DOWN).over
    assert not step(0.6, 2, ready=2, starting=0, was_over=True, up=UP, down=DOWN).over  # fell to the down threshold


def test_no_reading_or_no_ready_replica_is_never_over():
    assert step(None, 2, ready=2, starting=0, was_over=True, up=UP, down=DOWN).over is False
    assert step(3.0, 0, ready=0, starting=1, was_over=True, up=UP, down=DOWN).over is False


# -- the tick -----------------------------------------------------------------------------------


def model_with_objectives(*, ttft=1.0, itl=None, ready=1, max_replicas=6):
    node = make_node("gpu-a")
    model = make_model("llama", min_replicas=1, max_replicas=max_replicas)
    profile = model.profiles.get()
    profile.ttft_objective_seconds, profile.itl_objective_seconds = ttft, itl
    profile.save()
    for gpu in range(ready):
        make_replica(profile, placement=[(node, [gpu])], last_used=timezone.now())
    # Ready since before the routers' window: the window saw them serve all along.
    Replica.objects.filter(model=model).update(ready_at=timezone.now() - timedelta(hours=1))
    return model


pytestmark = pytest.mark.django_db


def test_a_model_over_its_objective_for_long_enough_scales_out_by_what_the_ratio_asks(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 30
    model = model_with_objectives(ttft=1.0, ready=2)
    start = timezone.now()
    slow = {"llama": ttft_window(2.5)}  # p90 between 2 s and 2.5 s: 2.45 s, ratio 2.45

    assert apply_demand(set(), start, in_flight={"llama": 1}, windows=slow).scaled_out == 0
    load = ModelLoad.objects.get(model=model)
    assert load.busy_since == start and load.pressure == pytest.approx(2.45)
    assert load.ttft_p90 == pytest.approx(2.45) and load.ttft_attained == 0.0

    # In flight far below target concurrency: only the objective speaks.
    assert apply_demand(set(), start + timedelta(seconds=30), in_flight={"llama": 1}, windows=slow).scaled_out == 2
    assert Replica.objects.filter(model=model, state=ReplicaState.PENDING).count() == 2


def test_a_wobble_between_the_thresholds_does_not_restart_the_wait(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 30
    model = model_with_objectives(ttft=1.0, ready=2)
    start = timezone.now()
    slow = {"llama": ttft_window(2.5)}
    middling = {"llama": _mixed(fast=80, slow=20)}  # p90 0.875 s: between the thresholds

    apply_demand(set(), start, in_flight={}, windows=slow)
    assert apply_demand(set(), start + timedelta(seconds=10), in_flight={}, windows=middling).scaled_out == 0
    assert ModelLoad.objects.get(model=model).busy_since == start  # still over: the clock kept running
    assert apply_demand(set(), start + timedelta(seconds=30), in_flight={}, windows=slow).scaled_out > 0


def _mixed(fast: int, slow: int) -> ModelWindow:
    counts = [0] * (len(FIRST_TOKEN_BUCKETS) + 1)
    counts[FIRST_TOKEN_BUCKETS.index(0.5)] = fast
    counts[FIRST_TOKEN_BUCKETS.index(1)] = slow
    return ModelWindow(ttft=counts)


def test_falling_to_the_down_threshold_ends_the_wait(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 30
    model = model_with_objectives(ttft=1.0, ready=2)
    start = timezone.now()
    apply_demand(set(), start, in_flight={}, windows={"llama": ttft_window(2.5)})
    apply_demand(set(), start + timedelta(seconds=10), in_flight={}, windows={"llama": ttft_window(0.5)})
    assert ModelLoad.objects.get(model=model).busy_since is None


def test_too_few_first_tokens_say_nothing(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 0
    model = model_with_objectives(ttft=1.0, ready=1)
    few = {"llama": ttft_window(600, count=MIN_OBSERVATIONS - 1)}
    assert apply_demand(set(), timezone.now(), in_flight={"llama": 1}, windows=few).scaled_out == 0
    load = ModelLoad.objects.get(model=model)
    assert load.pressure is None and load.ttft_p90 is None and load.busy_since is None


def test_the_inter_token_objective_counts_too_and_the_worst_ratio_wins(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 0
    model = model_with_objectives(ttft=10.0, itl=0.05, ready=1)
    gaps = [0] * (len(INTER_TOKEN_BUCKETS) + 1)
    gaps[INTER_TOKEN_BUCKETS.index(0.1)] = 200  # p90 0.099 s against 0.05 s
    window = ModelWindow(ttft=ttft_window(0.5).ttft, itl=gaps)
    assert apply_demand(set(), timezone.now(), in_flight={}, windows={"llama": window}).scaled_out == 1
    load = ModelLoad.objects.get(model=model)
    assert load.pressure == pytest.approx(0.099 / 0.05) and load.itl_attained == 0.0 and load.ttft_attained == 1.0


def test_a_model_without_objectives_keeps_the_concurrency_rule(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 0
    model = model_with_objectives(ttft=None, ready=1)
    model.profiles.update(target_concurrency=4)
    slow = {"llama": ttft_window(600)}
    assert apply_demand(set(), timezone.now(), in_flight={"llama": 2}, windows=slow).scaled_out == 0
    assert apply_demand(set(), timezone.now(), in_flight={"llama": 9}, windows=slow).scaled_out == 1
    load = ModelLoad.objects.get(model=model)
    assert load.pressure is None and load.ttft_p90 == pytest.approx(570.0)  # still shown to operators


def test_scale_out_on_objectives_stops_at_max_replicas(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 0
    model = model_with_objectives(ttft=1.0, ready=2, max_replicas=3)
    assert apply_demand(set(), timezone.now(), in_flight={}, windows={"llama": ttft_window(5)}).scaled_out == 1
    assert Replica.objects.filter(model=model).count() == 3


def test_the_queue_and_served_tokens_are_recorded_for_the_operators_view(settings):
    model = model_with_objectives(ttft=None, ready=1)
    waits = [0] * (len(QUEUE_WAIT_BUCKETS) + 1)
    waits[QUEUE_WAIT_BUCKETS.index(1)] = 10
    served = {"red": 900, "blue": 300}
    window = ModelWindow(waiting={"batch": 7}, waits={"interactive": waits}, served=served, weights={"red": 3})
    apply_demand(set(), timezone.now(), in_flight={"llama": 3}, windows={"llama": window})
    load = ModelLoad.objects.get(model=model)
    assert load.queue == {"batch": {"waiting": 7}, "interactive": {"waiting": 0, "wait_p90": 0.95}}
    assert load.served == {"red": {"tokens": 900, "weight": 3}, "blue": {"tokens": 300, "weight": 1}}


def test_objective_scaling_runs_a_constant_number_of_queries(settings, django_assert_max_num_queries):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 0
    model_with_objectives(ttft=1.0, ready=2)
    for i in range(5):
        make_model(f"other-{i}", min_replicas=0).profiles.update(ttft_objective_seconds=1.0)
    windows = {"llama": ttft_window(5), **{f"other-{i}": ttft_window(5) for i in range(5)}}
    apply_demand(set(), timezone.now(), in_flight={}, windows=windows)
    with django_assert_max_num_queries(6):
        apply_demand(set(), timezone.now(), in_flight={}, windows=windows)


def test_the_tick_reads_the_p90_from_every_live_routers_window_summed(run_tick):
    """Two routers' windows add up bucket by bucket: a p90 of the summed counts, not an average of each one's."""
    model = model_with_objectives(ttft=10.0, ready=1)
    hub = get_hub()
    fast = ttft_window(0.5, count=80)
    slow = ttft_window(5, count=20)
    async_to_sync(hub.report_usage)(UsageReport(router="a", windows={"llama": fast}))
    async_to_sync(hub.report_usage)(UsageReport(router="b", windows={"llama": slow}))

    run_tick()

    load = ModelLoad.objects.get(model=model)
    assert load.ttft_p90 == pytest.approx(4 + 1 * 0.5)  # rank 90 of 100: the middle of the slow bucket
    assert load.ttft_attained == 1.0


# -- spare replicas: parked when calm, recalled when pressed -------------------------------------


def calm(settings, ready=3, **model):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS = 30
    settings.LLMGW_LATENCY_WINDOW_SECONDS = 60
    return model_with_objectives(ttft=1.0, ready=ready, **model)


def parked(model):
    return sorted(Replica.objects.filter(model=model, parked_since__isnull=False).values_list("pk", flat=True))


def test_a_model_calm_for_a_whole_window_parks_the_replicas_its_pressure_does_not_need(settings):
    model = calm(settings, ready=4)
    newest = sorted(Replica.objects.filter(model=model).values_list("pk", flat=True))[2:]
    start = timezone.now()
    fast = {"llama": ttft_window(0.4)}  # p90 0.39 s against 1 s: × 4 / 2 = 0.78, × 4 / 1 = 1.56
    apply_demand(set(), start, in_flight={}, windows=fast)
    apply_demand(set(), start + timedelta(seconds=30), in_flight={}, windows=fast)
    assert parked(model) == []  # calm, but not for a whole window yet
    apply_demand(set(), start + timedelta(seconds=60), in_flight={}, windows=fast)
    assert parked(model) == newest  # two keep the pressure below 0.9; the two newest are parked


def test_parking_never_goes_below_one_serving_and_waits_a_window_between_steps(settings):
    model = calm(settings, ready=3)
    start, idle = timezone.now(), {"llama": ttft_window(0.025)}
    for seconds in (0, 60, 90, 120, 300):
        apply_demand(set(), start + timedelta(seconds=seconds), in_flight={}, windows=idle)
        if seconds == 90:
            assert len(parked(model)) == 2
    assert len(parked(model)) == 2  # never below one serving (min replicas 1)


def test_pressure_at_the_up_threshold_recalls_every_parked_replica_before_starting_any(settings):
    model = calm(settings, ready=3)
    Replica.objects.filter(model=model).exclude(pk=Replica.objects.filter(model=model).first().pk).update(
        parked_since=timezone.now()
    )
    # One serving at a ratio of 2.35: two more wanted, and two are parked: they come back, nothing starts.
    outcome = apply_demand(set(), timezone.now(), in_flight={}, windows={"llama": ttft_window(2.5)})
    assert parked(model) == [] and outcome.created == 0
    assert Replica.objects.filter(model=model).count() == 3


def test_a_parked_replica_is_published_below_every_profiles_priority_and_goes_idle(settings):
    model = calm(settings, ready=2)
    spare = Replica.objects.filter(model=model).latest("pk")
    Replica.objects.filter(pk=spare.pk).update(parked_since=timezone.now())
    rows = {row.replica_id: row.priority for row in build_endpoint_table().endpoints}
    assert rows[str(spare.pk)] == PARKED_PRIORITY < -32768 and sorted(rows.values())[-1] == 0


def test_the_pressure_is_read_on_the_replicas_serving_not_the_parked_ones(settings):
    model = calm(settings, ready=2)
    Replica.objects.filter(pk=Replica.objects.filter(model=model).latest("pk").pk).update(parked_since=timezone.now())
    apply_demand(set(), timezone.now(), in_flight={}, windows={"llama": ttft_window(1)})  # ratio 0.975
    assert ModelLoad.objects.get(model=model).pressure == pytest.approx(0.975)  # 0.975 × 1 seen / 1 serving


def test_a_model_whose_objectives_are_removed_has_its_parked_replicas_back(settings):
    model = calm(settings, ready=2)
    Replica.objects.filter(model=model).update(parked_since=timezone.now())
    model.profiles.update(ttft_objective_seconds=None)
    apply_demand(set(), timezone.now(), in_flight={"llama": 1}, windows={})
    assert parked(model) == []


def test_a_replica_whose_load_would_press_the_others_past_the_up_threshold_is_not_parked(settings):
    model = calm(settings, ready=2)
    start, calm_enough = timezone.now(), {"llama": ttft_window(0.6)}  # pressure 0.59: calm, but × 2/1 = 1.18
    for seconds in (0, 60, 120):
        apply_demand(set(), start + timedelta(seconds=seconds), in_flight={}, windows=calm_enough)
    assert parked(model) == []


def test_while_replicas_it_added_start_the_next_step_waits_a_whole_window(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS, settings.LLMGW_LATENCY_WINDOW_SECONDS = 5, 60
    model = model_with_objectives(ttft=1.0, ready=2)
    start, slow = timezone.now(), {"llama": ttft_window(10)}  # ratio 9.5: far over, whatever is starting
    apply_demand(set(), start, in_flight={}, windows=slow)
    assert apply_demand(set(), start + timedelta(seconds=5), in_flight={}, windows=slow).scaled_out == 2
    Replica.objects.filter(model=model, state=ReplicaState.PENDING).update(state=ReplicaState.STARTING)  # placed
    assert apply_demand(set(), start + timedelta(seconds=30), in_flight={}, windows=slow).scaled_out == 0
    assert apply_demand(set(), start + timedelta(seconds=65), in_flight={}, windows=slow).scaled_out == 2
    assert Replica.objects.filter(model=model).count() == 6


def test_nothing_is_parked_while_replicas_are_starting(settings):
    model = calm(settings, ready=3)
    Replica.objects.create(model=model, profile=model.profiles.get(), state=ReplicaState.STARTING)
    start, fast = timezone.now(), {"llama": ttft_window(0.25)}
    for seconds in (0, 60, 120):
        apply_demand(set(), start + timedelta(seconds=seconds), in_flight={}, windows=fast)
    assert parked(model) == []


# -- looking ahead by a start -------------------------------------------------------------------


def test_a_rising_load_is_projected_over_the_learned_start_time():
    trend = [[1000.0, 40.0], [1015.0, 50.0], [1030.0, 60.0]]
    growth, kept = look_ahead(trend, 80, now=1045.0, start_seconds=90, window_seconds=60)
    # 40 more streams a window over 45 s: 0.89 a second, × 90 s of start = 80 more on 80: twice the load.
    assert growth == pytest.approx(2.0)
    assert kept[-1] == [1045.0, 80.0] and kept[0] == [1000.0, 40.0]


@pytest.mark.parametrize(
    ("trend", "streams", "start", "why"),
    [
        ([[1000.0, 80.0]], 40, 90, "a falling load"),
        ([[1000.0, 20.0]], 80, None, "no learned start time"),
        ([[1030.0, 20.0]], 80, 90, "a trend of less than half a window"),
        ([[1000.0, 5.0]], 10, 90, "too few streams"),
    ],
)
def test_no_look_ahead_without_a_rise_to_project(trend, streams, start, why):
    assert look_ahead(trend, streams, now=1045.0, start_seconds=start, window_seconds=60)[0] == 1.0, why


def test_the_look_ahead_is_bounded_and_forgets_what_is_older_than_its_window():
    growth, kept = look_ahead([[0.0, 1.0], [1000.0, 20.0]], 1000, now=1045.0, start_seconds=600, window_seconds=60)
    assert growth == 4.0 and [t for t, _ in kept] == [1000.0, 1045.0]
    _, again = look_ahead(kept, 1000, now=1050.0, start_seconds=600, window_seconds=60)
    assert len(again) == 2  # a sample a quarter of a window apart at most


def test_a_model_whose_load_rises_asks_for_the_replicas_it_will_need_once_they_have_started(settings):
    settings.LLMGW_SCALE_OUT_AFTER_SECONDS, settings.LLMGW_LATENCY_WINDOW_SECONDS = 0, 60
    model = model_with_objectives(ttft=1.0, ready=2)
    model.profiles.update(start_seconds=60)
    start = timezone.now()
    apply_demand(set(), start - timedelta(seconds=45), in_flight={}, windows={"llama": ttft_window(0.5, count=40)})
    # The load doubled in 45 s and its p90 is at 0.975 of the objective: looking 60 s ahead, the load grows by
    # 2/3 more, so two replicas more rather than one.
    rising = {"llama": ttft_window(1, count=80)}
    assert apply_demand(set(), start, in_flight={}, windows=rising).scaled_out == 2
    assert ModelLoad.objects.get(model=model).pressure == pytest.approx(0.975 * (1 + 40 / 45 * 60 / 80))
