"""The fast path against the step-by-step reference with degradation levels and silent corruption on: batch limits
changed mid-run, requests shed, a corrupt node's requests moved off live (as tests/recovery/sim/test_fast_path.py
holds it to the reference without them)."""

import pytest

from recovery.sim import scenario as scenarios
from recovery.sim.bench import _largest_error
from recovery.sim.fleet import Simulation
from recovery.sim.metrics import request_metrics, run_metrics


@pytest.fixture(scope="module")
def both_paths() -> tuple[Simulation, Simulation]:
    """Six nodes in two racks at 92 % of their capacity: b-1 corrupts at 3 s, a-1 crashes at 6 s and comes back,
    a-2 crashes at 12 s for good; levels 1 and 2 come and go, best-effort traffic is shed for a while."""
    scenario = scenarios.parse(
        {
            "duration_s": 45,
            "fleet": [
                {"name": "a", "count": 3, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "rack-a"},
                {"name": "b", "count": 3, "model": "Qwen3-32B", "gpu": "H100-SXM", "tp": 2, "rack": "rack-b"},
            ],
            "workload": {"rate_rps": 12},
            "faults": {
                "per_1000_node_days": 0,
                "scripted": [
                    {"at_s": 3.0, "kind": "sdc", "target": "b-1", "repair_s": 10},
                    {"at_s": 6.0, "kind": "crash", "target": "a-1", "repair_s": 5},
                    {"at_s": 12.0, "kind": "crash", "target": "a-2"},
                ],
            },
            "degradation": {"required_share": 0.92},
        }
    )
    reference = Simulation(scenario, "lifeline", 2).run()
    fast = Simulation(scenario, "lifeline", 2, fast=True).run()
    return reference, fast


def test_the_features_are_at_work_in_the_compared_run(both_paths):
    reference, _ = both_paths
    assert {c.new for c in reference.degradation.changes} >= {1, 2}
    assert sum(1 for f in reference.flights if f.shed) > 10
    sdc = next(r for r in reference.fault_records if r.fault.kind == "sdc")
    assert sdc.interrupted > 0 and sdc.possibly_corrupt


def test_every_request_has_the_reference_s_path_and_latency(both_paths):
    reference, fast = both_paths
    ours = [request_metrics(f) for f in fast.flights]
    theirs = [request_metrics(f) for f in reference.flights]
    assert len(ours) == len(theirs) > 400
    worst = _largest_error([(m.ttft_s, m.tpot_s) for m in ours], [(m.ttft_s, m.tpot_s) for m in theirs])
    assert worst <= 0.01, worst
    for a, b in zip(fast.flights, reference.flights):
        assert (a.node, a.emitted, a.methods, a.holders, a.shed, a.level, a.possibly_corrupt) == (
            b.node,
            b.emitted,
            b.methods,
            b.holders,
            b.shed,
            b.level,
            b.possibly_corrupt,
        ), a.request_id


def test_the_run_s_figures_levels_and_sheds_are_the_reference_s(both_paths):
    reference, fast = both_paths
    assert fast.degradation.changes == reference.degradation.changes
    assert fast.steps_simulated == reference.steps_simulated
    ours, theirs = run_metrics(fast).to_json(), run_metrics(reference).to_json()
    assert ours.pop("events") < theirs.pop("events")
    assert ours == theirs
