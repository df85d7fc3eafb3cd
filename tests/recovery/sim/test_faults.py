"""The simulator's faults: the rate, the cause mix, the outages and the detection delays (recovery.sim.faults)."""

import math
import random
import statistics
from collections import Counter

import pytest

from recovery.sim.distributions import LogNormal
from recovery.sim.errors import ScenarioError
from recovery.sim.faults import (
    DAY_S,
    DETECTION,
    HOUR_S,
    META_LLAMA3_MIX,
    STEPFUN_OUTAGE,
    DetectionDefaults,
    Fault,
    FaultRates,
    detect,
)


def quantile(values: list[float], p: float) -> float:
    return sorted(values)[int(p * len(values))]


# --- outages -----------------------------------------------------------------------------------
def test_the_outage_fit_has_stepfuns_median_and_p90():
    assert STEPFUN_OUTAGE.median == pytest.approx(22 * HOUR_S)
    assert STEPFUN_OUTAGE.quantile(0.9) == pytest.approx(341 * HOUR_S)
    assert STEPFUN_OUTAGE.sigma == pytest.approx(math.log(341 / 22) / 1.2815515655446004)
    assert STEPFUN_OUTAGE.mean / HOUR_S == pytest.approx(216.6, rel=0.01)  # the docstring's figure


def test_drawn_outages_have_stepfuns_median_and_p90_within_sampling_error():
    rng = random.Random(4)
    hours = [STEPFUN_OUTAGE.sample(rng) / HOUR_S for _ in range(40_000)]
    # sigma 2.14: the sampling error of the median is about 1.3 %, of the p90 about 1.8 % (log scale).
    assert quantile(hours, 0.5) == pytest.approx(22, rel=0.05)
    assert quantile(hours, 0.9) == pytest.approx(341, rel=0.07)


def test_a_lognormal_needs_its_p90_above_its_median():
    with pytest.raises(ValueError):
        LogNormal.from_median_p90(22, 10)


# --- the rate ----------------------------------------------------------------------------------
def test_the_default_rate_is_four_faults_per_thousand_node_days():
    assert FaultRates().expected_faults(node_days=1000) == pytest.approx(4.0)
    assert FaultRates(per_1000_node_days=10).expected_faults(node_days=250) == pytest.approx(2.5)


def test_drawn_faults_come_at_the_rate():
    # Short outages, so the nodes are in service all the time: 1,000 nodes for 250 days expect 1,000 faults.
    rates = FaultRates(outage=LogNormal.from_median_p90(60, 120))
    nodes = [f"n{i}" for i in range(1000)]
    faults = rates.draw(nodes, [], 250 * DAY_S, seed=1)
    assert len(faults) == pytest.approx(rates.expected_faults(1000 * 250), rel=0.1)  # Poisson: sd 32
    assert all(0 <= f.at_s < 250 * DAY_S for f in faults)
    assert [f.at_s for f in faults] == sorted(f.at_s for f in faults)


def test_a_node_out_for_repair_does_not_fail_again_until_it_is_back():
    rates = FaultRates(per_1000_node_days=200_000)  # about 200 a day: many would land inside a 22 h outage
    faults = rates.draw(["n1"], [], 30 * DAY_S, seed=3)
    assert len(faults) >= 2
    for before, after in zip(faults, faults[1:]):
        assert after.at_s >= before.back_at_s


def test_the_kinds_follow_metas_mix():
    rates = FaultRates(per_1000_node_days=1000, outage=LogNormal.from_median_p90(1, 2))  # one a day per node
    faults = rates.draw([f"n{i}" for i in range(100)], [], 100 * DAY_S, seed=2)  # about 10,000
    shares = Counter(f.kind for f in faults)
    total = sum(META_LLAMA3_MIX.values())
    assert total == 419
    for kind, weight in META_LLAMA3_MIX.items():
        assert shares[kind] / len(faults) == pytest.approx(weight / total, abs=0.015)
    assert "rack" not in shares


def test_rack_events_come_at_their_own_rate_and_only_when_asked_for():
    by_default = FaultRates(per_1000_node_days=1000).draw(["n1"], ["r1", "r2"], 365 * DAY_S, seed=1)
    assert by_default and all(f.kind != "rack" for f in by_default)
    rates = FaultRates(per_1000_node_days=0, rack_per_1000_rack_days=1000, outage=LogNormal.from_median_p90(1, 2))
    faults = rates.draw(["n1"], ["r1", "r2"], 500 * DAY_S, seed=1)
    assert {f.kind for f in faults} == {"rack"} and {f.target for f in faults} == {"r1", "r2"}
    assert len(faults) == pytest.approx(1000, rel=0.12)


def test_a_seed_gives_the_same_faults_and_a_node_added_leaves_the_others_alone():
    rates = FaultRates(per_1000_node_days=5000)
    fleet = [f"n{i}" for i in range(20)]
    first = rates.draw(fleet, ["r1"], 30 * DAY_S, seed=8)
    assert first == rates.draw(fleet, ["r1"], 30 * DAY_S, seed=8)
    assert first != rates.draw(fleet, ["r1"], 30 * DAY_S, seed=9)
    grown = rates.draw([*fleet, "n20"], ["r1"], 30 * DAY_S, seed=8)
    assert [f for f in grown if f.target != "n20"] == first


def test_another_mix_changes_what_fails_not_when():
    fleet = [f"n{i}" for i in range(20)]
    meta = FaultRates(per_1000_node_days=5000).draw(fleet, [], 30 * DAY_S, seed=8)
    crashes = FaultRates(per_1000_node_days=5000, mix={"crash": 1}).draw(fleet, [], 30 * DAY_S, seed=8)
    assert [(f.at_s, f.target, f.repair_s) for f in meta] == [(f.at_s, f.target, f.repair_s) for f in crashes]
    assert {f.kind for f in crashes} == {"crash"}


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"per_1000_node_days": -1}, "per_1000_node_days"),
        ({"rack_per_1000_rack_days": float("nan")}, "rack_per_1000_rack_days"),
        ({"mix": {"meteor": 1}}, "mix.meteor"),
        ({"mix": {"crash": -1}}, "mix.crash"),
        ({"mix": {"crash": 0}}, "mix"),
    ],
)
def test_impossible_rates_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ScenarioError) as refused:
        FaultRates(**kwargs)
    assert refused.value.field == field


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"at_s": 1, "kind": "meteor", "target": "n1"}, "kind"),
        ({"at_s": -1, "kind": "crash", "target": "n1"}, "at_s"),
        ({"at_s": 1, "kind": "crash", "target": "n1", "repair_s": 0}, "repair_s"),
    ],
)
def test_impossible_faults_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ScenarioError) as refused:
        Fault(**kwargs)
    assert refused.value.field == field


# --- detection ---------------------------------------------------------------------------------
def delays(kind: str, n: int = 5000, defaults: DetectionDefaults = DETECTION) -> list:
    rng = random.Random(6)
    return [detect(kind, rng, defaults) for _ in range(n)]


def test_the_detection_defaults_are_the_shipped_ones():
    # console/settings.py, recovery/models.py Cluster, recovery/gateway/table.py and watch.py
    assert (DETECTION.heartbeat_interval_s, DETECTION.heartbeat_miss_s, DETECTION.heartbeat_check_s) == (1, 3, 1)
    assert (DETECTION.canary_interval_s, DETECTION.canary_retry_s) == (30, 2)
    assert (DETECTION.suspicious_after, DETECTION.unhealthy_after) == (1, 3)
    assert (DETECTION.stall_timeout_s, DETECTION.event_stream_timeout_s) == (5, 9)


def test_a_crash_leaves_routing_when_its_streams_break_and_is_down_after_the_heartbeat_miss():
    found = delays("crash")
    assert all(d.routing_s == DETECTION.stream_break_s == 0.00895 for d in found)  # measured: benchmarks/move_hop.py
    confirmed = [d.confirmed_s for d in found]
    assert 2.0 <= min(confirmed) and max(confirmed) <= 4.0  # miss 3 s, minus up to a beat, plus up to a check
    assert statistics.mean(confirmed) == pytest.approx(3.0, abs=0.05)


def test_a_hang_is_found_by_the_heartbeat_miss_before_the_stall_timeout():
    found = delays("hang")
    assert all(d.routing_s == d.confirmed_s and d.by == "heartbeat miss" for d in found)
    assert statistics.mean(d.routing_s for d in found) == pytest.approx(3.0, abs=0.05)
    # With a slower heartbeat miss the gateway's stall timeout of a request in flight is first.
    slow = delays("hang", 100, DetectionDefaults(heartbeat_miss_s=30))
    assert all(d.routing_s == 5.0 and d.by == "stall timeout" for d in slow)
    assert all(d.confirmed_s > 29 for d in slow)


def test_silent_corruption_is_unhealthy_at_the_third_failed_canary():
    found = delays("sdc")
    suspicious = [d.suspicious_s for d in found]
    unhealthy = [d.confirmed_s for d in found]
    assert 0 <= min(suspicious) and max(suspicious) < 30  # the next canary, at most an interval away
    assert all(u - s == pytest.approx(4.0) for u, s in zip(unhealthy, suspicious))  # two retries 2 s apart
    assert statistics.mean(unhealthy) == pytest.approx(15 + 4, abs=0.5)
    assert all(d.routing_s == d.confirmed_s for d in found)  # weight 0 at UNHEALTHY, 0.5 before


def test_a_lost_gpu_fails_its_requests_at_once_and_its_xid_rides_the_next_heartbeat():
    found = delays("gpu_lost")
    assert all(d.routing_s == 0 and 0 <= d.confirmed_s <= 1.0 for d in found)


def test_a_rack_is_found_as_a_hang_of_each_node():
    assert statistics.mean(d.confirmed_s for d in delays("rack")) == pytest.approx(3.0, abs=0.05)


def test_detection_settings_that_cannot_be_are_refused():
    with pytest.raises(ScenarioError) as refused:
        DetectionDefaults(unhealthy_after=0)
    assert refused.value.field == "unhealthy_after"
    with pytest.raises(ScenarioError) as refused:
        DetectionDefaults(suspicious_after=4)
    assert refused.value.field == "suspicious_after"
    with pytest.raises(ScenarioError):
        detect("meteor", random.Random(1))
