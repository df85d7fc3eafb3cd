"""Degradation levels in the simulator: the control plane's capacity policy over the simulated nodes, and the
gateways' shedding by it (recovery/sim/degradation.py)."""

import pytest

from recovery.policy.capacity import EFFECTS
from recovery.sim import scenario as scenarios
from recovery.sim.errors import ScenarioError
from recovery.sim.fleet import Simulation
from recovery.sim.metrics import request_metrics, run_metrics
from recovery.sim.workload import DEFAULT_TIER_MIX
from workers import catalog

MODEL, GPU, TP = "Qwen3-32B", "H100-SXM", 2
LOAD_S = catalog.load_time_s(catalog.MODELS[MODEL])
HOLD_S, EVERY_S = 30.0, 2.0


def four_nodes(*faults: dict, duration_s: float = 150, rate_rps: float = 4, **degradation) -> scenarios.Scenario:
    """Four nodes whose objective is 92 % of what they carry (the demo's): one lost is level 1, two level 2,
    three level 3, four level 4."""
    return scenarios.parse(
        {
            "duration_s": duration_s,
            "fleet": [{"name": "a", "count": 4, "model": MODEL, "gpu": GPU, "tp": TP}],
            "workload": {"rate_rps": rate_rps},
            "faults": {"per_1000_node_days": 0, "scripted": list(faults)},
            "degradation": {"required_share": 0.92, **degradation},
        }
    )


def crash(at_s: float, target: str, repair_s: float | None = None) -> dict:
    fault = {"at_s": at_s, "kind": "crash", "target": target}
    if repair_s is not None:
        fault["repair_s"] = repair_s
    return fault


def level_at(sim: Simulation, t: float) -> int:
    """The model's level at `t`, from the run's level changes."""
    level = 0
    for change in sim.degradation.changes:
        if change.at_s <= t:
            level = change.new
    return level


@pytest.fixture(scope="module")
def two_lost_then_back() -> Simulation:
    """a-1 crashes at 5 s and is back (repair, then its model load) at 10 s + LOAD_S; a-2 crashes at 10 s and is
    back at 70 s + LOAD_S."""
    scenario = four_nodes(crash(5.0, "a-1", 5.0), crash(10.0, "a-2", 60.0))
    return Simulation(scenario, "lifeline", 1, fast=True).run()


def test_the_level_rises_with_each_node_lost_and_falls_after_the_hold_once_they_are_back(two_lost_then_back):
    sim = two_lost_then_back
    changes = sim.degradation.changes
    assert [(c.old, c.new) for c in changes] == [(0, 1), (1, 2), (2, 1), (1, 0)]
    up1, up2, down1, down0 = changes
    # Worse at once: at the first evaluation after the control plane's DOWN (a heartbeat miss, 2 to 4 s).
    assert 5.0 + 2.0 <= up1.at_s <= 5.0 + 4.0 + EVERY_S and up1.ratio == pytest.approx(3 / 4 / 0.92)
    assert 10.0 + 2.0 <= up2.at_s <= 10.0 + 4.0 + EVERY_S and up2.ratio == pytest.approx(2 / 4 / 0.92)
    assert (up1.in_service, up2.in_service) == (3, 2)
    # Better only after the ratio has cleared the better level for the hold.
    back1, back2 = 10.0 + LOAD_S, 70.0 + LOAD_S
    assert HOLD_S <= down1.at_s - back1 <= HOLD_S + 2 * EVERY_S
    assert HOLD_S <= down0.at_s - back2 <= HOLD_S + 2 * EVERY_S
    seconds = run_metrics(sim).seconds_at_level[MODEL]
    assert set(seconds) == {0, 1, 2}
    assert sum(seconds.values()) == pytest.approx(sim.now)
    assert seconds[2] == pytest.approx(down1.at_s - up2.at_s)


def test_best_effort_is_shed_at_level_2_and_not_before_and_no_other_tier_is(two_lost_then_back):
    sim = two_lost_then_back
    shed_at_level_1 = 0
    for flight in sim.flights:
        level = level_at(sim, flight.request.arrival_s)
        if flight.request.tier == "best_effort" and level >= 2:
            assert flight.shed == (429, 2), flight.request_id
            assert flight.finished_at is None and flight.emitted == 0 and not flight.spans
        else:
            assert flight.shed is None, flight.request_id
            assert flight.finished_at is not None
            shed_at_level_1 += flight.request.tier == "best_effort" and level == 1
    assert shed_at_level_1 > 5  # best-effort requests arrived at level 1 and were served
    metrics = run_metrics(sim)
    shed = [f for f in sim.flights if f.shed]
    assert metrics.shed == len(shed) > 10
    assert metrics.shed_by_tier == {"premium": 0, "standard": 0, "best_effort": len(shed)}
    assert metrics.shed_detail == [
        {"model": MODEL, "tier": "best_effort", "level": 2, "code": 429, "requests": len(shed)}
    ]
    assert metrics.finished == metrics.requests - metrics.shed
    assert [c["new"] for c in metrics.level_changes] == [1, 2, 1, 0]
    assert {request_metrics(f).shed_code for f in shed} == {429}


def test_the_nodes_batch_limit_follows_the_level_and_comes_back():
    sim = Simulation(four_nodes(crash(5.0, "a-1", 5.0), crash(10.0, "a-2", 60.0)), "lifeline", 1, fast=True)
    sim.run(until=20.0)
    assert sim.degradation.level(MODEL) == 2
    for node in sim.nodes.values():  # the lost ones too: they come back with it
        assert node.core.batch_factor == EFFECTS[2].batch_factor and node.core.batch_limit == 96
    assert sim.nodes["a-3"].status.batch_limit == 96  # as the node publishes it
    sim.run()
    assert sim.degradation.level(MODEL) == 0
    assert all(node.core.batch_limit == 128 for node in sim.nodes.values())


def test_level_3_sheds_best_effort_and_relaxes_latency_and_level_4_refuses_every_new_request():
    scenario = four_nodes(
        crash(5.0, "a-1"), crash(5.0, "a-2"), crash(5.0, "a-3"), crash(20.0, "a-4"), duration_s=40, rate_rps=3
    )
    sim = Simulation(scenario, "lifeline", 1, fast=True).run()
    levels = [c.new for c in sim.degradation.changes]  # three DOWN verdicts may land in one evaluation or more
    assert levels == sorted(levels) and levels[-2:] == [3, 4]
    at3, at4 = (c.at_s for c in sim.degradation.changes[-2:])
    assert at3 <= 5.0 + 4.0 + EVERY_S and 20.0 + 2.0 <= at4 <= 20.0 + 4.0 + EVERY_S
    assert sim.nodes["a-4"].core.batch_factor == EFFECTS[3].batch_factor == 0.5
    by_level: dict[int, list] = {3: [], 4: []}
    for flight in sim.flights:
        t = flight.request.arrival_s
        if at3 <= t < at4:
            by_level[3].append(flight)
            assert (flight.shed is not None) == (flight.request.tier == "best_effort")
        elif t >= at4:
            by_level[4].append(flight)
            assert flight.shed == (503, 4)
    assert len(by_level[3]) > 10 and len(by_level[4]) > 10
    relaxed = [request_metrics(f) for f in by_level[3] if f.finished_at is not None and f.finished_at < at4]
    assert relaxed and all(m.level == 3 and m.latency_slo_factor == 2.0 for m in relaxed)
    assert run_metrics(sim).shed_by_tier["premium"] == sum(f.request.tier == "premium" for f in by_level[4])


def test_without_an_objective_there_is_no_level_and_no_evaluation():
    scenario = scenarios.parse(
        {
            "duration_s": 10,
            "fleet": [{"name": "a", "count": 2, "model": MODEL, "gpu": GPU, "tp": TP}],
            "workload": {"rate_rps": 2},
            "faults": {"per_1000_node_days": 0, "scripted": [crash(2.0, "a-1")]},
        }
    )
    sim = Simulation(scenario, "lifeline", 1).run()
    assert not sim.degradation.enabled and sim.degradation.changes == []
    metrics = run_metrics(sim)
    assert metrics.shed == 0 and metrics.seconds_at_level == {} and metrics.level_changes == []


def test_an_objective_in_requests_per_second_and_its_errors():
    scenario = four_nodes(required_rps={MODEL: 1.0})  # far below what the fleet carries
    sim = Simulation(scenario, "lifeline", 1, fast=True)
    assert sim.degradation.models[MODEL].required_rps == 1.0
    with pytest.raises(ScenarioError, match=r"degradation.required_rps.Llama-3-70B: is not served"):
        four_nodes(required_rps={"Llama-3-70B": 1.0})
    with pytest.raises(ScenarioError, match=r"degradation.required_share: 0"):
        four_nodes(required_share=0)
    with pytest.raises(ScenarioError, match=r"degradation.hold: is not a field here"):
        four_nodes(hold=3)


def test_tiers_are_drawn_from_the_mix_deterministically_and_leave_the_rest_of_the_requests_alone():
    base = {
        "duration_s": 200,
        "fleet": [{"name": "a", "count": 1, "model": MODEL, "gpu": GPU, "tp": TP}],
        "workload": {"rate_rps": 10},
        "faults": {"per_1000_node_days": 0},
    }
    requests = scenarios.parse(base).requests(1)
    assert requests == scenarios.parse(base).requests(1)
    shares = {tier: sum(r.tier == tier for r in requests) / len(requests) for tier, _ in DEFAULT_TIER_MIX}
    assert all(abs(share - 1 / 3) < 0.05 for share in shares.values())
    premium = scenarios.parse({**base, "workload": {"rate_rps": 10, "tiers": {"premium": 1}}}).requests(1)
    assert {r.tier for r in premium} == {"premium"}
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in premium] == [
        (r.arrival_s, r.prompt_tokens, r.output_tokens) for r in requests
    ]
    with pytest.raises(ScenarioError, match=r"workload\[0\].tiers.gold: is not a tier"):
        scenarios.parse({**base, "workload": {"rate_rps": 10, "tiers": {"gold": 1}}})
