"""The health, breaker and capacity policies (source document 003) as pure functions."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recovery.policy import breaker as breakers
from recovery.policy import capacity, health
from recovery.policy.health import CanaryAnswer, GoldenToken
from tests.helpers import examples
from workers.catalog import Deployment

GOLDEN = [GoldenToken(11, -0.20), GoldenToken(42, -1.10)]
H100 = Deployment.of("Qwen3-32B", "H100-SXM", 2)
H200 = Deployment.of("Qwen3-32B", "H200-SXM", 2)


def answer(ids=(11, 42), tops=(-0.2, -1.1), ms=20.0):
    return CanaryAnswer(tuple(ids), tuple(tops), ms)


# --- canary verdicts -----------------------------------------------------------------------------
def test_a_matching_answer_passes():
    verdict = health.judge_canary(GOLDEN, answer(), 20.0)
    assert verdict.passed and verdict.kind == "ok"


@pytest.mark.parametrize(
    "got, failure, kind",
    [
        (None, "timeout: no answer within 3 s", "timeout"),
        (None, "no_response: connection refused", "no_response"),
        (answer(ids=(11, 43)), None, "token_mismatch"),
        (answer(ids=(11,), tops=(-0.2,)), None, "token_mismatch"),
        (answer(tops=(-0.2, -2.0)), None, "logprob_out_of_range"),
        (answer(tops=(-0.2, None)), None, "logprob_out_of_range"),
        (answer(ms=200.0), None, "latency_spike"),
    ],
)
def test_each_of_document_003s_checks_fails_on_its_own(got, failure, kind):
    verdict = health.judge_canary(GOLDEN, got, 20.0, failure=failure)
    assert not verdict.passed and verdict.kind == kind and verdict.detail


def test_the_logprob_range_is_the_golden_value_plus_or_minus_the_tolerance():
    assert health.judge_canary(GOLDEN, answer(tops=(-0.2, -1.55)), None, logprob_tolerance=0.5).passed
    assert not health.judge_canary(GOLDEN, answer(tops=(-0.2, -1.65)), None, logprob_tolerance=0.5).passed


def test_a_latency_spike_needs_three_times_the_baseline_and_a_real_gap():
    assert not health.judge_canary(GOLDEN, answer(ms=61.0), 20.0, latency_factor=3.0, min_spike_ms=0).passed
    assert health.judge_canary(GOLDEN, answer(ms=59.0), 20.0, latency_factor=3.0, min_spike_ms=0).passed
    # 4 ms against a 1 ms baseline is the host's scheduling noise, not a sick GPU
    assert health.judge_canary(GOLDEN, answer(ms=4.0), 1.0).passed
    assert health.judge_canary(GOLDEN, answer(ms=500.0), None).passed  # no baseline yet


def test_the_latency_limit_scales_with_how_slow_the_fleets_canaries_answer_now():
    # 4× the baseline fails alone, and passes while the other nodes' canaries run 2× theirs (a busy host).
    assert not health.judge_canary(GOLDEN, answer(ms=80.0), 20.0, min_spike_ms=0).passed
    verdict = health.judge_canary(GOLDEN, answer(ms=80.0), 20.0, min_spike_ms=0, fleet_factor=2.0)
    assert verdict.passed
    slow = health.judge_canary(GOLDEN, answer(ms=130.0), 20.0, min_spike_ms=0, fleet_factor=2.0)
    assert not slow.passed and "× 2.00, the other nodes' canaries' slowness now" in slow.detail
    assert health.judge_canary(GOLDEN, answer(ms=80.0), 20.0, min_spike_ms=0, fleet_factor=0.5).passed is False


def test_the_fleets_slowness_is_the_lower_median_of_at_least_two_peers():
    assert health.fleet_slowdown([]) == 1.0 and health.fleet_slowdown([6.0]) == 1.0  # too few to say
    assert health.fleet_slowdown([6.0, 1.0]) == 1.0  # one slow peer of two never excuses a node
    assert health.fleet_slowdown([6.0, 5.0, 1.0]) == 5.0
    assert health.fleet_slowdown([0.8, 0.9, 0.7]) == 1.0  # faster than usual: the node's own limit
    assert health.fleet_slowdown([float("nan"), 3.0, 4.0]) == 3.0


def test_without_a_golden_run_only_the_answer_and_latency_count():
    assert health.judge_canary(None, answer(ids=(7,), tops=(-3.0,)), 20.0).passed
    assert not health.judge_canary(None, None, 20.0, failure="timeout: 3 s").passed


def test_the_baseline_is_an_exponential_moving_average():
    assert health.next_baseline(None, 30.0) == 30.0
    assert health.next_baseline(20.0, 30.0) == pytest.approx(21.0)


# --- health states -----------------------------------------------------------------------------------
def test_one_failure_is_suspicious_three_are_unhealthy_a_pass_is_healthy():
    step = health.after_canary(health.HEALTHY, 0, False)
    assert (step.state, step.failures, step.propose_drain) == (health.SUSPICIOUS, 1, False)
    step = health.after_canary(step.state, step.failures, False)
    assert (step.state, step.failures) == (health.SUSPICIOUS, 2)
    step = health.after_canary(step.state, step.failures, False)
    assert (step.state, step.failures, step.propose_drain) == (health.UNHEALTHY, 3, True)
    again = health.after_canary(step.state, step.failures, False)
    assert again.state == health.UNHEALTHY and not again.propose_drain  # proposed once
    back = health.after_canary(again.state, again.failures, True, breaker=breakers.HALF_OPEN)  # its trial passed
    assert (back.state, back.failures) == (health.HEALTHY, 0)


def test_a_draining_node_stays_draining_whatever_its_canaries_say():
    assert health.after_canary(health.DRAINING, 5, True).state == health.DRAINING
    assert health.after_canary(health.DRAINING, 5, False) == health.HealthStep(health.DRAINING, 6, False)


def test_routing_weights():
    assert health.routing_weight(health.HEALTHY) == 1.0
    assert health.routing_weight(health.SUSPICIOUS) == 0.5
    for state in (health.UNHEALTHY, health.DRAINING):
        assert health.routing_weight(state) == 0.0
    assert health.routing_weight(health.HEALTHY, cordoned=True) == 0.0
    assert health.routing_weight(health.HEALTHY, spare=True) == 0.0
    assert health.routing_weight(health.HEALTHY, breaker=breakers.HALF_OPEN) == 0.0
    assert health.routing_weight(health.SUSPICIOUS, breaker=breakers.OPEN) == 0.0


@given(st.lists(st.booleans(), max_size=40))
def test_health_follows_the_consecutive_failures(results):
    state, failures = health.HEALTHY, 0
    for passed in results:
        was = state
        step = health.after_canary(state, failures, passed)
        state, failures = step.state, step.failures
        if passed:  # an UNHEALTHY node returns only through its breaker's half-open trial
            assert state == (health.UNHEALTHY if was == health.UNHEALTHY else health.HEALTHY) and failures == 0
        else:
            assert state == (health.UNHEALTHY if failures >= 3 or was == health.UNHEALTHY else health.SUSPICIOUS)


# --- Xid events ---------------------------------------------------------------------------------------
def test_xid_severities_follow_the_reference_table():
    for code in (46, 48, 62, 64, 74, 79, 95, 109, 119, 120):
        assert health.xid_info(code).severity == health.CRITICAL, code
    for code in (13, 31, 43, 45, 63, 92, 94):
        assert health.xid_info(code).severity == health.WARN, code
    assert health.xid_info(48).action == "drain, reset GPU"
    assert health.xid_info(79).action == "reboot node"
    unknown = health.xid_info(999)
    assert unknown.severity == health.WARN and "999" in unknown.meaning


def test_a_burst_on_one_gpu_is_one_event_and_other_gpus_are_their_own():
    events = [(100.0, 0, 48), (100.001, 0, 48), (100.002, 0, 45), (103.0, 0, 48), (100.5, 1, 13), (130.0, 0, 13)]
    bursts = health.group_xids(events, window_s=10.0)
    assert [(b.gpu, b.codes) for b in bursts] == [(0, {48: 3, 45: 1}), (1, {13: 1}), (0, {13: 1})]
    assert bursts[0].severity == health.CRITICAL and bursts[0].worst == 48
    assert bursts[1].severity == health.WARN and bursts[2].first_at == 130.0


# --- circuit breakers ----------------------------------------------------------------------------------
def test_the_breaker_opens_after_three_failures_and_tries_once_after_the_timeout():
    b = breakers.Breaker()
    for _ in range(2):
        b = b.on_failure(0.0)
        assert b.state == breakers.CLOSED
    b = b.on_failure(1.0)
    assert b.state == breakers.OPEN and b.opened_at == 1.0
    allowed, b = b.allow(30.0, open_s=60)
    assert not allowed and b.state == breakers.OPEN
    allowed, b = b.allow(61.0, open_s=60)
    assert allowed and b.state == breakers.HALF_OPEN
    allowed, b = b.allow(62.0, open_s=60)
    assert not allowed  # one trial call only
    assert b.on_success() == breakers.Breaker()  # the trial passed: closed
    reopened = b.on_failure(63.0)
    assert reopened.state == breakers.OPEN and reopened.opened_at == 63.0


def test_a_success_resets_the_count_and_an_open_breaker_ignores_it():
    b = breakers.Breaker().on_failure(0).on_failure(0).on_success().on_failure(0)
    assert b.state == breakers.CLOSED and b.failures == 1
    opened = breakers.Breaker(breakers.OPEN, 3, 0.0)
    assert opened.on_success() == opened


@given(st.lists(st.tuples(st.sampled_from(["fail", "ok", "ask"]), st.floats(0, 10)), max_size=60))
def test_a_half_open_breaker_lets_through_one_call_per_timeout(ops):
    b, now, allowed_while_half_open = breakers.Breaker(), 0.0, []
    for op, dt in ops:
        now += dt
        if op == "fail":
            b = b.on_failure(now)
            allowed_while_half_open = []
        elif op == "ok":
            b = b.on_success()
            allowed_while_half_open = []
        else:
            was = b.state
            allowed, b = b.allow(now, open_s=5.0)
            if was == breakers.OPEN and b.opened_at is not None:
                assert allowed == (b.state == breakers.HALF_OPEN)
            if b.state == breakers.HALF_OPEN and allowed:
                allowed_while_half_open.append(now)
        # two trials are at least a timeout apart
        assert all(
            later - earlier >= 5.0 for earlier, later in zip(allowed_while_half_open, allowed_while_half_open[1:])
        )
        assert b.state in breakers.STATES


def test_the_cluster_breaker_allows_a_share_of_the_fleet_and_at_least_one():
    assert breakers.auto_cordons_allowed(100, 0.10) == 10
    assert breakers.auto_cordons_allowed(8, 0.10) == 1
    assert not breakers.cluster_breaker_trips(0, 8, 0.10)
    assert breakers.cluster_breaker_trips(1, 8, 0.10)
    assert not breakers.cluster_breaker_trips(9, 100, 0.10) and breakers.cluster_breaker_trips(10, 100, 0.10)
    with pytest.raises(ValueError, match="max_share"):
        breakers.auto_cordons_allowed(8, 0)


# --- capacity and degradation ----------------------------------------------------------------------------
SLO = capacity.Slo(ttft_ms=2000, tpot_ms=100, required_rps=100, avg_prompt_tokens=512, avg_output_tokens=256)


def test_a_node_carries_more_on_a_faster_gpu_and_less_when_it_runs_slow():
    h100, h200 = capacity.node_capacity(H100, SLO), capacity.node_capacity(H200, SLO)
    assert 0 < h100.rps < h200.rps
    slowed = capacity.node_capacity(H100, SLO, slowdown=2.0)
    assert slowed.rps < h100.rps
    assert capacity.node_capacity(H100, SLO, slowdown=0.5) == h100  # faster than the model is not believed


def test_tight_objectives_limit_the_batch_and_impossible_ones_give_nothing():
    tight = capacity.node_capacity(H100, capacity.Slo(tpot_ms=17, avg_prompt_tokens=512, avg_output_tokens=256))
    loose = capacity.node_capacity(H100, SLO)
    assert tight.limited_by == "tpot" and tight.batch < loose.batch and tight.rps < loose.rps
    assert (
        H100.step_s(0, 0, tight.batch, tight.batch * 640)
        <= 0.017
        < H100.step_s(0, 0, tight.batch + 1, (tight.batch + 1) * 640)
    )
    assert capacity.node_capacity(H100, capacity.Slo(tpot_ms=1)).rps == 0
    assert capacity.node_capacity(H100, capacity.Slo(ttft_ms=1, avg_prompt_tokens=8000)).limited_by == "ttft"
    long_context = capacity.node_capacity(
        H100, capacity.Slo(ttft_ms=600_000, tpot_ms=1000, avg_prompt_tokens=100_000, avg_output_tokens=1000)
    )
    assert long_context.limited_by == "kv" and long_context.batch == H100.kv_capacity_tokens // 101_000


def test_the_slowdown_is_measured_against_the_model():
    model_ms = H100.step_s(0, 0, 8, 8000) * 1000  # the whole step, tensor-parallel all-reduces included
    assert capacity.slowdown(H100, model_ms, 8, 8000) == 1.0
    assert capacity.slowdown(H100, 2 * model_ms, 8, 8000) == pytest.approx(2.0)
    assert capacity.slowdown(H100, 0, 8, 8000) == 1.0 and capacity.slowdown(H100, 30, 0, 0) == 1.0
    assert capacity.slowdown(H100, 1.1 * model_ms, 8, 8000) == 1.0  # jitter, not the GPU
    over_pcie = H100.step_s(0, 0, 8, 8000, "pcie") * 1000  # NVLink down: the all-reduces cross PCIe
    assert over_pcie / model_ms > 1.15 and capacity.slowdown(H100, over_pcie, 8, 8000) == pytest.approx(
        over_pcie / model_ms
    )


@pytest.mark.parametrize(
    "ratio, level",
    [(1.5, 0), (1.0, 0), (0.99, 1), (0.75, 1), (0.6, 2), (0.5, 2), (0.3, 3), (0.25, 3), (0.2, 4), (0.0, 4)],
)
def test_levels_follow_document_003(ratio, level):
    assert capacity.level_for(ratio) == level


def test_levels_rise_at_once_and_fall_after_the_hold_with_a_margin():
    d = capacity.next_level(0, 0.6, now=0, better_since=None)
    assert (d.level, d.changed) == (2, True)
    d = capacity.next_level(2, 1.02, now=10, better_since=None, margin=0.05, hold_s=30)
    assert (d.level, d.changed, d.better_since) == (2, False, 10)  # 1.02 clears level 1's 0.75, not level 0's 1.0 by 5%
    assert capacity.next_level(2, 1.02, now=39, better_since=10, margin=0.05, hold_s=30) == capacity.LevelDecision(
        2, 10, False
    )
    assert capacity.next_level(2, 1.02, now=40, better_since=10, margin=0.05, hold_s=30) == capacity.LevelDecision(
        1, None, True
    )
    assert capacity.next_level(1, 1.10, now=41, better_since=None, hold_s=30).level == 1
    assert capacity.next_level(1, 0.70, now=42, better_since=41).level == 2  # worse again: at once, the hold restarts
    assert capacity.next_level(1, 0.80, now=42, better_since=30).better_since is None  # no longer better: forgotten


@settings(max_examples=examples(200))
@given(st.lists(st.floats(0, 2), min_size=1, max_size=50), st.floats(0, 60))
def test_a_level_never_falls_sooner_than_the_hold(ratios, hold):
    level, since, last_rise = 0, None, 0.0
    for t, ratio in enumerate(ratios):
        d = capacity.next_level(level, ratio, float(t), since, 0.05, hold)
        if d.level > level:
            last_rise = float(t)
        if d.level < level:
            assert t - (since if since is not None else t) >= hold
            assert capacity.level_for(ratio / 1.05) == d.level
        assert d.level >= capacity.level_for(ratio)  # never better than the ratio says
        level, since = d.level, d.better_since
    assert 0 <= level <= capacity.MAX_LEVEL and not math.isnan(last_rise)


def test_the_effects_of_each_level():
    assert capacity.EFFECTS[0] == capacity.Effects(1.0, (), 1.0, True)
    assert capacity.EFFECTS[1].batch_factor == 0.75 and not capacity.EFFECTS[1].shed_tiers
    assert capacity.EFFECTS[2].shed_tiers == ("best_effort",)
    assert capacity.EFFECTS[3] == capacity.Effects(0.5, ("best_effort",), 2.0, True)
    assert not capacity.EFFECTS[4].accept_new
