"""The SLO arithmetic (recovery.policy.slo): bounds, percentiles, budgets, burn rates and the SRE workbook's alerts."""

import datetime as dt
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from recovery.policy import slo

TARGETS = slo.Targets(ttft_ms=450, tpot_ms=40)


def test_a_threshold_must_be_a_bucket_bound_and_the_refusal_names_the_nearest():
    assert slo.check_threshold("ttft", 450) == 450
    with pytest.raises(slo.NotABucketBound) as refused:
        slo.check_threshold("ttft", 470)
    assert "450 ms and 500 ms" in str(refused.value)
    assert refused.value.nearest == (450, 500)
    with pytest.raises(slo.NotABucketBound, match="25 ms and 30 ms"):
        slo.check_threshold("tpot", 27)


def test_every_shipped_default_is_a_bucket_bound():
    for model in ("Qwen3-32B", "Llama-3-70B", "Llama-3-8B", "Mixtral-8x7B", "unknown"):
        for tier in ("premium", "standard", "best_effort"):
            default = slo.default_for(model, tier)
            assert slo.check_threshold("ttft", default.ttft_ms) and slo.check_threshold("tpot", default.tpot_ms)
    # MLPerf's Llama-2-70B: interactive (premium) 450 / 40 ms, server (standard) 2,000 / 200 ms, p99.
    assert (slo.default_for("Qwen3-32B", "premium").ttft_ms, slo.default_for("Qwen3-32B", "premium").tpot_ms) == (
        450,
        40,
    )
    assert (slo.default_for("Llama-3-70B", "standard").ttft_ms, slo.default_for("Llama-3-70B", "standard").tpot_ms) == (
        2000,
        200,
    )


@given(
    st.lists(st.floats(min_value=0.1, max_value=100_000), min_size=1, max_size=200), st.sampled_from(slo.TTFT_BOUNDS_MS)
)
def test_good_under_a_bound_is_exact_and_percentiles_are_within_one_bucket(values, threshold):
    counts = [0] * (len(slo.TTFT_BOUNDS_MS) + 1)
    for v in values:
        counts[slo.bucket_index(slo.TTFT_BOUNDS_MS, v)] += 1
    assert slo.good_under(slo.TTFT_BOUNDS_MS, counts, threshold) == sum(v <= threshold for v in values)
    for q in (50, 90, 99):
        exact = sorted(values)[math.ceil(len(values) * q / 100) - 1]
        read = slo.percentile(slo.TTFT_BOUNDS_MS, counts, q)
        assert read >= exact
        i = slo.bucket_index(slo.TTFT_BOUNDS_MS, exact)
        assert read == (slo.TTFT_BOUNDS_MS[i] if i < len(slo.TTFT_BOUNDS_MS) else math.inf)


def test_no_measurements_no_percentile_and_no_attainment():
    assert slo.percentile(slo.TPOT_BOUNDS_MS, [0] * 26, 99) is None
    assert slo.attainment(0, 0) is None
    assert slo.budget_remaining(0, 0, 0.999) is None
    assert slo.burn_rate(0, 0, 0.999) is None


def test_budget_and_burn_rate():
    # 99.9% over 100,000 requests: 100 may fail. 25 did: a quarter of the budget spent, burning at 0.25×.
    assert slo.attainment(99_975, 100_000) == pytest.approx(0.99975)
    assert slo.budget_remaining(99_975, 100_000, 0.999) == pytest.approx(0.75)
    assert slo.burn_rate(99_975, 100_000, 0.999) == pytest.approx(0.25)
    assert slo.budget_remaining(99_800, 100_000, 0.999) == pytest.approx(-1.0)  # overspent: negative
    assert slo.goodput(600, 60) == 10
    assert slo.budget_badge(None) == "grey" and slo.budget_badge(-0.1) == "red" and slo.budget_badge(0.9) == "green"


def _rates(**given_rates):
    rates = dict.fromkeys(slo.BURN_WINDOWS_S, 0.0)
    rates.update(given_rates)
    return rates


PLENTY = dict.fromkeys(slo.BURN_WINDOWS_S, 10_000)


@pytest.mark.parametrize(
    "rates, state, rule",
    [
        ({"1h": 14.4, "5m": 15.0}, "page", "page: 14.4× over 1h and 5m"),
        ({"6h": 6.0, "30m": 7.0}, "page", "page: 6× over 6h and 30m"),
        ({"1d": 3.0, "2h": 3.5}, "ticket", "ticket: 3× over 1d and 2h"),
        ({"3d": 1.0, "6h": 1.2}, "ticket", "ticket: 1× over 3d and 6h"),
    ],
)
def test_each_sre_workbook_rule_fires_over_both_its_windows(rates, state, rule):
    alert = slo.alert_state(_rates(**rates), PLENTY)
    assert alert.state == state
    assert rule in alert.firing


@pytest.mark.parametrize(
    "rates",
    [
        {"1h": 14.4, "5m": 14.0},  # the short window has already recovered
        {"1h": 14.0, "5m": 50.0},  # a short spike that has not burnt an hour's worth
        {"6h": 5.9, "30m": 10.0},
        {"1d": 3.0, "2h": 2.9},
        {"3d": 0.99, "6h": 5.0},
        {},
    ],
)
def test_a_rule_stays_silent_unless_both_windows_burn(rates):
    assert slo.alert_state(_rates(**rates), PLENTY).state == "ok"


def test_the_traffic_guard_stops_a_page_on_little_traffic_and_says_so():
    rates = _rates(**{"1h": 50.0, "5m": 50.0})
    few = {**PLENTY, "1h": 12}
    alert = slo.alert_state(rates, few, min_valid_for_page=100)
    assert alert.state == "ok"
    assert alert.guarded == ("page: 14.4× over 1h and 5m",)
    assert slo.alert_state(rates, few, min_valid_for_page=10).state == "page"


def test_no_traffic_at_all_is_no_data_not_ok():
    assert slo.alert_state(dict.fromkeys(slo.BURN_WINDOWS_S), {}).state == "no data"


def test_a_minute_counts_each_outcome_as_the_definitions_say():
    minute = slo.MinuteRollup()
    minute.add("ok", 200, 300.0, 30.0, TARGETS, level=0)  # good everywhere
    minute.add("ok", 200, 500.0, 30.0, TARGETS, level=0)  # TTFT missed: not joint good
    minute.add("ok", 200, 300.0, None, TARGETS, level=0)  # one token: no TPOT to judge
    minute.add("error", 502, 200.0, None, TARGETS, level=0)  # server-side failure
    minute.add("shed", 429, None, None, TARGETS, level=2)  # shed: against its tier, at level 2
    minute.add("rejected", 503, None, None, TARGETS, level=3)  # an overloaded node's 503: shed too
    minute.add("rejected", 400, None, None, TARGETS)  # the client's fault
    minute.add("client_gone", 499, 100.0, None, TARGETS)  # the client hung up
    assert (minute.valid, minute.good, minute.server_errors, minute.shed) == (6, 3, 1, 2)
    assert minute.shed_by_level == {"2": 1, "3": 1}
    assert (minute.client_errors, minute.client_gone) == (1, 1)
    assert (minute.ttft_valid, minute.ttft_good, minute.tpot_valid, minute.tpot_good) == (4, 3, 2, 2)
    assert minute.joint_good == 2
    assert sum(minute.ttft_hist) == 4 and sum(minute.tpot_hist) == 2
    doubled = slo.MinuteRollup().merge(minute).merge(minute)
    assert doubled.valid == 12 and doubled.shed_by_level == {"2": 2, "3": 2} and sum(doubled.ttft_hist) == 8


def test_windows_and_months():
    now = dt.datetime(2025, 3, 31, 12, 30, tzinfo=dt.UTC)
    assert slo.window_start("calendar_month", now) == dt.datetime(2025, 3, 1, tzinfo=dt.UTC)
    assert slo.window_start("rolling_28d", now) == now - dt.timedelta(days=28)
    assert slo.months_before(now, 13) == dt.datetime(2024, 2, 29, 12, 30, tzinfo=dt.UTC)
    assert slo.months_before(now, 1) == dt.datetime(2025, 2, 28, 12, 30, tzinfo=dt.UTC)
