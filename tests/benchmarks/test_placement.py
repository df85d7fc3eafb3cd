"""benchmarks.placement: the offered load of the Table 1 comparison is set without any placement, the same for every
placement, so that no placement is favoured by the load it is judged on."""

import dataclasses
import inspect

import pytest

from benchmarks import placement as bp
from recovery.policy import planner
from recovery.sim import planning


def test_the_offered_load_takes_no_placement_and_makes_none(monkeypatch):
    assert list(inspect.signature(bp.offered_load).parameters) == ["servers", "demands", "share"]
    servers = bp.table1_fleet()
    expected = bp.offered_load(servers)

    def no_plan(*args, **kwargs):
        raise AssertionError("the offered load asked the planner")

    monkeypatch.setattr(planner, "plan", no_plan)
    assert bp.offered_load(servers) == expected


def test_the_offered_load_is_a_share_of_the_fleets_capacity_at_the_published_ratio():
    servers = bp.table1_fleet()
    fleet = bp.fleet_capacity(servers)
    assert fleet["fleet_gpus"] == 56
    demands = bp.offered_load(servers, share=0.5)
    published = {d.model: d.rate_rps for d in bp.TABLE1_DEMANDS}
    for d in demands:
        assert d.rate_rps == pytest.approx(published[d.model] * fleet["scale"] * 0.5, abs=0.005)
        assert dataclasses.replace(d, rate_rps=0) == dataclasses.replace(
            next(p for p in bp.TABLE1_DEMANDS if p.model == d.model), rate_rps=0
        )
    # At share 1 the models' GPU-seconds per second fill every GPU of the fleet.
    full = bp.offered_load(servers, share=1.0)
    used = sum(d.rate_rps / fleet["per_gpu_rps_fleet_mean"][d.model] for d in full)
    assert used == pytest.approx(fleet["fleet_gpus"], rel=1e-3)
    # Every GPU type of the fleet counts, per GPU (a GH200 serves Llama-2-13B faster than an A100).
    assert bp.per_gpu_capacity(bp.TABLE1_DEMANDS[0], "GH200", 4) > bp.per_gpu_capacity(
        bp.TABLE1_DEMANDS[0], "A100-80GB", 8
    )


def test_every_placement_is_judged_on_the_same_load_whatever_the_planner_places(monkeypatch):
    """The old setup scaled the load to the planner's own placement's capacity: a planner that claimed more capacity
    got a heavier load for everyone. Now the planner's answer changes nothing of the load."""
    servers = bp.table1_fleet()
    seen: list[tuple] = []

    def evaluate(servers_, assignment, demands, duration_s=60.0, seed=1):
        seen.append(tuple(demands))
        return {d.model: planning.ModelFigures(d.model, 0, 0, 0, 0, 1.0, 0.0, 0.0, *[None] * 5) for d in demands}

    monkeypatch.setattr(planning, "evaluate", evaluate)
    monkeypatch.setattr(planning, "simulated_capacities", lambda *args, **kwargs: {})
    real_plan = planner.plan

    def judged_loads(capacity_factor: float) -> set:
        def plan(*args, **kwargs):
            result = real_plan(*args, **kwargs)
            result.capacity_rps = {m: rps * capacity_factor for m, rps in result.capacity_rps.items()}
            return result

        monkeypatch.setattr(planner, "plan", plan)
        seen.clear()
        out = bp.table1(1.0, shares=(bp.FLEET_LOAD_SHARE,))
        assert out["demands"] == [dataclasses.asdict(d) for d in bp.offered_load(servers)]
        assert out["judge"] and out["offered_load"]["old_setup_bias"]
        return set(seen)

    as_planned = judged_loads(1.0)
    assert as_planned == {tuple(bp.offered_load(servers))}  # one load, for all five placements
    assert len(seen) == 5
    assert judged_loads(2.0) == as_planned  # the planner claiming twice the capacity moves no load


def test_the_planners_lead_is_over_the_best_placement_not_its_own():
    lead = bp.planner_lead(
        {
            "Lifeline planner": 1.0,
            "Lifeline planner, simulated capacities": 0.99,
            "memP (ours)": 0.5,
            "LLMFabric (published)": 1.0,
        }
    )
    assert lead == {"best_other": "LLMFabric (published)", "points": 0.0}  # a tie: no advantage
    assert bp.planner_lead({"Lifeline planner": 0.999, "memP (ours)": 0.545, "LLMFabric (published)": 0.749}) == {
        "best_other": "LLMFabric (published)",
        "points": 25.0,
    }
